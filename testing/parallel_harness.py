"""One tiny training run with a given strategy, recording what the equivalence tests compare.

Used in-process for the single-process reference and by `dist_parallel_runs.py` under torchrun for the layouts,
so both sides build exactly the same config, data and seed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.data.packing import PADDING_DOCUMENT, ROW_LENGTHS
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.parallel.tensor_parallel import gather_tensor_parallel
from mtnlg_lightning.quick_exit import skip_final_garbage_collection
from mtnlg_lightning.train.module import MTNLGModule
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy
from testing.gathered_weights import full_state_dict
from testing.lightning_run import TINY_RECIPE, quiet_trainer
from testing.local_ranks import run_on_ranks

SEED = 1234
# Small enough that clipping triggers on every step of the tiny model (its grad norm is ~0.3 .. 2).
GRAD_CLIP = 0.05
CAPTURE_STEP = 5
# The suite runs on CPU (gloo); scripts/gpu_check.sh runs the same checks with MTNLG_TEST_ACCELERATOR=gpu (NCCL).
ACCELERATOR = os.environ.get("MTNLG_TEST_ACCELERATOR", "cpu")


class Recorder(Callback):
    """Per-step train_loss / grad_norm / lr as logged (synced over ranks) and the gathered parameters at steps
    (step 0: the initial ones), in fp32: under bf16 ZeRO the master weights, which the updates act on."""

    def __init__(self, capture_steps=(CAPTURE_STEP,)):
        self.capture_steps = set(capture_steps)
        self.losses, self.grad_norms, self.lrs = [], [], []
        self.router_logs: list[dict[str, float]] = []  # a mixture of experts': its router losses, expert loads
        self.params: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer, pl_module):
        if trainer.global_step in self.capture_steps:  # step 0: the initial parameters
            self._capture(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.losses.append(float(metrics["train_loss"]))
        self.grad_norms.append(float(metrics["grad_norm"]))
        self.lrs.append(float(metrics["lr"]))
        self.router_logs.append({k: float(v) for k, v in metrics.items() if k.startswith(("router_", "moe_"))})
        if trainer.global_step in self.capture_steps:
            self._capture(trainer, pl_module)

    def _capture(self, trainer, pl_module):
        strategy = trainer.strategy
        if isinstance(strategy, MegatronDeepSpeedStrategy):
            full = full_state_dict(strategy, master=True)  # fp32 master weights under bf16
        else:
            full = {k: v.detach().clone() for k, v in pl_module.model.named_parameters()}
        self.params[trainer.global_step] = {k: v.float().cpu() for k, v in full.items()}


@torch.no_grad()
def tied_head_copy(strategy: MegatronDeepSpeedStrategy) -> torch.Tensor | None:
    """The last stage's copy of the word embedding (TP-gathered), on every rank; None without a cross-rank tie."""
    tied = strategy.tied_embedding
    copy_ = None
    if tied is not None and not tied.is_first:
        copy_ = tied.weight.detach().clone()
        if strategy.groups.tensor_parallel_size > 1:
            copy_ = gather_tensor_parallel(copy_, 0, strategy.groups.tensor_parallel_group)
        copy_ = copy_.cpu()
    parts = [None] * strategy.world_size
    dist.all_gather_object(parts, copy_)
    found = [part for part in parts if part is not None]
    return found[0].to(strategy.root_device) if found else None


class VetoStep(Callback):
    """Vetoes the update of one step (1-based), as a loss-spike callback would."""

    def __init__(self, step: int):
        self.step = step

    def should_skip_update(self, trainer, module, loss, grad_norm) -> bool:
        return trainer.global_step + 1 == self.step


class ScaleLossAt(Callback):
    """A poisoned batch: multiplies the training loss of the batch that starts at `consumed_samples` by `factor`.
    Keyed by data, not by step, so a rewind that skips the batch also skips the poison. Wraps whatever loss the
    strategy installed (vocab-parallel CE under TP), so it works under any layout."""

    def __init__(self, consumed_samples: int, factor: float = 1e3):
        self.consumed_samples, self.factor, self._original = consumed_samples, factor, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._original is None:
            self._original = pl_module.loss_fn
        original, factor = self._original, self.factor
        poisoned = int(batch["consumed_samples"]) == self.consumed_samples
        pl_module.loss_fn = (lambda logits, labels: original(logits, labels) * factor) if poisoned else original


class IgnoreLabels(Callback):
    """Sets labels to IGNORE_INDEX on a share of each sample's positions, a share that differs by sample (about a
    quarter to three quarters), so micro-batches and data-parallel ranks hold different counts of trained labels.
    Which positions depends only on the sample's place in the stream, never on the layout: every layout trains on
    the same labels."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["labels"] = ignore_some_labels(batch["labels"], sample_index(trainer, batch))


class PackDocuments(Callback):
    """Cuts each sample into documents of random lengths (3 to 24 tokens, drawn from the sample's place in the
    stream, never the layout): `document_ids` and `position_ids` restarting at each document, and the label of each
    document's last token (the next document's first) ignored, as a packed row carries them. `document_ids=False`:
    the same positions and labels without the ids (attention crosses the boundaries: a negative control)."""

    def __init__(self, document_ids: bool = True):
        self.document_ids = document_ids

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        packed = pack_documents(batch["labels"], sample_index(trainer, batch))
        if not self.document_ids:
            del packed["document_ids"]
        batch.update(packed)


PADDED_SEQ_LEN = 256  # `PadRows`' runs: rows of 8 to 200 tokens, micro-batches of many widths below 256


class PadRows(Callback):
    """Makes each sample one example followed by padding, as unpacked fine-tuning rows are (`data.packing`): the
    window's first L tokens (L from 8 to 200, drawn from the sample's place in the stream, never the layout), then
    pad id 0, PADDING_DOCUMENT, ignored labels, and each row's length in ROW_LENGTHS, which lets a layout cut each
    micro-batch to its longest row. Run with `seq_len` 256, so micro-batches differ in width."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch.update(pad_rows(batch, sample_index(trainer, batch)))


def pad_rows(batch: dict, samples: list[int]) -> dict[str, torch.Tensor]:
    rows, width = batch["labels"].shape
    lengths = torch.tensor([int(torch.randint(8, 201, (), generator=torch.Generator().manual_seed(20_000 + s)))
                            for s in samples])  # fmt: skip
    index = torch.arange(width).expand(rows, width)
    padding = index >= lengths[:, None]
    last_or_padding = index >= lengths[:, None] - 1  # an example's last token predicts nothing
    device = batch["labels"].device
    return {
        "input_ids": batch["input_ids"].masked_fill(padding.to(device), 0),
        "labels": batch["labels"].masked_fill(last_or_padding.to(device), IGNORE_INDEX),
        "position_ids": torch.where(padding, index - lengths[:, None], index).to(device),
        "document_ids": torch.where(padding, PADDING_DOCUMENT, 0).to(device),
        ROW_LENGTHS: lengths.to(device),
    }


def pack_documents(labels: torch.Tensor, samples: list[int]) -> dict[str, torch.Tensor]:
    rows, length = labels.shape
    document_ids = torch.empty(rows, length, dtype=torch.long)
    position_ids = torch.empty(rows, length, dtype=torch.long)
    labels = labels.clone()
    for row, sample in enumerate(samples):
        generator = torch.Generator().manual_seed(10_000 + sample)
        start, document = 0, 0
        while start < length:
            end = min(length, start + int(torch.randint(3, 25, (), generator=generator)))
            document_ids[row, start:end] = document
            position_ids[row, start:end] = torch.arange(end - start)
            if end < length:  # the window's last label is the next token of its own document
                labels[row, end - 1] = IGNORE_INDEX
            start, document = end, document + 1
    device = labels.device
    return {"labels": labels, "document_ids": document_ids.to(device), "position_ids": position_ids.to(device)}


def sample_index(trainer, batch) -> list[int]:
    """The stream positions of this rank's rows (data-parallel rank r holds the r-th contiguous slice)."""
    local = len(batch["labels"])
    first = int(batch["consumed_samples"]) + getattr(trainer.strategy, "data_parallel_rank", 0) * local
    return list(range(first, first + local))


def ignore_some_labels(labels: torch.Tensor, samples: list[int]) -> torch.Tensor:
    labels = labels.clone()
    for row, sample in enumerate(samples):
        generator = torch.Generator().manual_seed(sample)
        share = 0.25 + 0.5 * torch.rand((), generator=generator).item()
        ignored = torch.rand(labels.shape[1], generator=generator) < share
        labels[row, ignored.to(labels.device)] = IGNORE_INDEX
    return labels


class CommPerStep(Callback):
    """Bytes of every torch.distributed call of the next-to-last training step (the last one also gathers the
    captured parameters), by group kind and op, max over ranks (`comm_counter.py`, installed by the
    launch before DeepSpeed starts). Disabled: records nothing."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.last = enabled, {}

    def on_train_start(self, trainer, pl_module):
        if self.enabled:
            from testing import comm_counter

            comm_counter.register_groups(trainer.strategy.groups)
            comm_counter.reset()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.enabled:
            from testing import comm_counter

            self.last = comm_counter.snapshot()  # the previous step, start to start
            comm_counter.reset()

    def result(self, trainer) -> dict:
        """{"comm": {"tp/all_gather_into_tensor": max bytes over ranks, ...}} (empty when disabled)."""
        if not self.enabled:
            return {}
        import torch.distributed as dist

        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {k: v["bytes"] for k, v in self.last.items()})
        keys = {k for rank in per_rank for k in rank}
        return {"comm": {k: max(rank.get(k, 0) for rank in per_rank) for k in keys}}


def tiny_run(
    strategy="auto",
    devices=1,
    max_steps=5,
    grad_clip=GRAD_CLIP,
    capture_steps=(CAPTURE_STEP,),
    checkpoint_dir=None,
    checkpoint_every=3,
    ckpt_path=None,
    callbacks=(),
    micro_batch_size=4,
    model_overrides=None,
    rampup_batch_size=None,
    precision="32-true",
    compile_backend=None,
    init_from=None,
    seq_len=None,
    lora=None,
    loss_chunk_tokens=None,
    module_settings=None,
) -> tuple[Recorder, L.Trainer]:
    """`micro_batch_size` changes only how the global batch of 8 is cut (the loss and gradients are the same
    mean); pipelines need several micro-batches per step. `model_overrides` e.g. {"num_layers": 5}. `precision`:
    Lightning's, e.g. "bf16-mixed" (autocast; under ZeRO DeepSpeed keeps bf16 weights and fp32 master weights).
    `compile_backend`: compile each block with this torch.compile backend (`model.compile: true`). `init_from`:
    start from a Hugging Face directory (its architecture). `seq_len`: train on longer sequences than the preset's.
    `lora`: train LoRA adapters of these settings on the frozen `init_from` model. `loss_chunk_tokens`: the
    module's (the LM head and its loss in chunks of this many tokens). `module_settings`: more `MTNLGModule`
    arguments (e.g. {"optimizer": "muon"})."""
    L.seed_everything(SEED, verbose=False)
    if seq_len is not None:  # the preset's position table grows with it (a source's stays its own)
        longer = {"seq_len": seq_len} | ({} if init_from else {"max_position_embeddings": seq_len})
        model_overrides = longer | (model_overrides or {})
    module = MTNLGModule(
        **TINY_RECIPE,
        model_overrides=model_overrides,
        micro_batch_size=micro_batch_size,
        global_batch_size=8,
        rampup_batch_size=rampup_batch_size,
        grad_clip=grad_clip,
        compile=compile_backend is not None,
        compile_backend=compile_backend or "inductor",
        init_from=init_from,
        lora=lora,
        loss_chunk_tokens=loss_chunk_tokens,
        **(module_settings or {}),
    )
    data = GPTDataModule(builtin_corpus="python-docs", seed=SEED)
    recorder = Recorder(capture_steps)
    cbs = [recorder, *callbacks]
    if checkpoint_dir is not None:
        cbs.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir, every_n_train_steps=checkpoint_every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = quiet_trainer(
        accelerator=ACCELERATOR,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=max_steps,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in cbs),
        callbacks=cbs,
        deterministic=True,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return recorder, trainer


def fine_tuning_module(base: str, seq_len: int, micro_batch_size: int, global_batch_size: int, lr: float, **settings):
    """A module that fine-tunes the model directory `base` in a layout test: the layout tests' clipping, no warmup,
    a cosine to lr / 10, none of a run's services (preemption, watchdog, straggler reports); `settings`: the
    objective's and the adapters' (objective, dpo_beta, grpo, rewards, lora, ...)."""
    return MTNLGModule(
        preset="tiny",
        init_from=base,
        model_overrides={"seq_len": seq_len},
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        lr=lr,
        min_lr=lr / 10,
        warmup_tokens=0,
        grad_clip=GRAD_CLIP,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
        **settings,
    )


def trained(rec: Recorder) -> dict:
    """What the layout comparisons compare of a run: losses, pre-clip gradient norms, captured parameters (and a
    mixture of experts' router logs, each step's)."""
    return {"losses": rec.losses, "grad_norms": rec.grad_norms, "params": rec.params, "router_logs": rec.router_logs}


def launch_runs(script: Path, out: Path, names: list[str], ranks: int = 2, args: tuple = ()) -> dict[str, dict]:
    """One torchrun launch of `script OUT ARGS... NAMES...` (a `run_each` script): each run's saved result by name."""
    proc = run_on_ranks(ranks, script, out, *args, *names, timeout=900, cwd=script.resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names}


def assert_trains_like(run: dict, reference: dict) -> None:
    """A layout's run reproduces one process: losses (fp32, rel 1e-6), pre-clip gradient norms, and the parameters
    after 5 clipped Adam steps (within the fp32 noise of re-ordered sums that the layout tests allow, 2e-5)."""
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(run["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0)
    params, expected = run["params"][5], reference["params"][5]
    assert params.keys() == expected.keys()
    assert max((params[k] - expected[k]).abs().max().item() for k in expected) <= 2e-5


def assert_resumes_like(resumed: dict, uninterrupted: dict) -> None:
    """A run resumed from a step-3 checkpoint continues the uninterrupted 6-step run: the losses of steps 4-6 (rel
    1e-5) and the parameters after step 6 (2e-5)."""
    assert len(resumed["losses"]) == 3  # steps 4-6 after the step-3 checkpoint
    torch.testing.assert_close(resumed["losses"], uninterrupted["losses"][3:6], rtol=1e-5, atol=0)
    apart = [(resumed["params"][6][k] - v).abs().max().item() for k, v in uninterrupted["params"][6].items()]
    assert max(apart) <= 2e-5


def run_each(tag: str, names: Iterable[str], out: Path, run: Callable[[str], dict]) -> None:
    """The named runs of a torchrun script in turn, on every rank; rank 0 saves each result (with its seconds) as
    OUT/<name>.pt for pytest."""
    for name in names:
        started = time.perf_counter()
        result = run(name)
        result["seconds"] = time.perf_counter() - started
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
            print(f"[{tag}] {name}: {result['seconds']:.1f}s losses={result.get('losses')}", flush=True)
        dist.barrier()


def run_named_with_source(tag: str, train: Callable[[str, Path, str], dict]) -> None:
    """The runs of a `SCRIPT OUT_DIR SOURCE NAME...` command line (SOURCE: e.g. a model directory), each
    `train(name, out, source)`, through `run_each`."""
    out, source = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    run_each(tag, sys.argv[3:], out, lambda name: train(name, out, source))


def run_script(main: Callable[[], None]) -> None:
    """A torchrun script's `__main__`: `main`, then the world torn down before the interpreter does: DeepSpeed/gloo
    threads left to static destructors can abort the process at exit ("terminate called without an active
    exception") after all the work succeeded."""
    skip_final_garbage_collection()  # as the commands do (quick_exit.py)
    main()
    dist.barrier()
    dist.destroy_process_group()
