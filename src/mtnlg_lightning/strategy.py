"""The Lightning Strategy: a thin adapter wiring the layout, tensor parallelism and ZeRO into Lightning's loop.

    trainer:
      strategy:
        class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy
        init_args: {tensor_parallel: 2, zero_stage: 1}

At start-up every rank builds the same `ParallelLayout` (pp, dp, tp; TP innermost), validates it against the
model, creates its process groups and rank 0 prints the table. `setup` shards the model (`parallelize`), swaps the
module's loss for the vocab-parallel cross-entropy, and either keeps the module's optimizer with a plain DP
all-reduce (`zero_stage: 0`) or hands model shard + optimizer to DeepSpeed ZeRO over the DP group (1, 2, 3).
The LightningModule keeps its loop: it calls `forward_backward` and `clip_and_step` here, and its LambdaLR keeps
setting the learning rate. Works under Lightning's launcher, torchrun and SLURM (Lightning's cluster environments).
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.distributed.constants import default_pg_timeout

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups, gpus_per_node_from_env
from mtnlg_lightning.parallel.pipeline import (
    MULTI_STAGE,
    V_SHAPED,
    PipelineChunks,
    PipelineRunner,
    TiedEmbedding,
    create_embedding_group,
    layers_per_stage,
    schedule_class,
    split_into_stages,
    stage_ranks,
)
from mtnlg_lightning.parallel.sequence_parallel import check_sequence_length
from mtnlg_lightning.parallel.tensor_parallel import (
    VocabParallelCrossEntropy,
    gather_tensor_parallel,
    is_tensor_parallel,
    parallelize,
)
from mtnlg_lightning.parallel.zero import (
    ModelParallelUnit,
    UpdateSnapshot,
    deepspeed_config,
    engine_backward,
    initialize_engine,
)

_META_FILE = "meta.pt"


class MegatronDeepSpeedStrategy(ParallelStrategy):
    strategy_name = "megatron_deepspeed"

    def __init__(
        self,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        pipeline_schedule: str = "1f1b",
        virtual_pipeline_stages: int | None = None,
        first_stage_layers: int | None = None,
        last_stage_layers: int | None = None,
        zero_stage: int = 1,
        gpus_per_node: int | None = None,
        allow_tp_across_nodes: bool = False,
        sequence_parallel: bool = False,
        deepspeed_config: dict | None = None,
        print_layout: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            tensor_parallel: Megatron TP degree (heads, MLP and vocabulary split); TP groups are consecutive ranks.
            pipeline_parallel: pipeline stages (outermost in the layout; usually one hop across nodes).
            pipeline_schedule: a `torch.distributed.pipelining` schedule: 1f1b (MT-NLG's), interleaved_1f1b,
                gpipe, looped_bfs, zbv_zero_bubble.
            virtual_pipeline_stages: stages per rank (interleaved schedules); default 2 for interleaved_1f1b,
                looped_bfs and zbv_zero_bubble, else 1.
            first_stage_layers, last_stage_layers: explicit block counts for the first/last stage (they also hold
                the embedding and the LM head); default: balanced by blocks (105 layers / 35 stages = 3 each).
            zero_stage: 0 = plain data-parallel all-reduce with the module's optimizer; 1, 2, 3 = DeepSpeed ZeRO
                over the data-parallel group (optimizer states / + gradients / + parameters partitioned).
            gpus_per_node: ranks per node for the topology; default from LOCAL_WORLD_SIZE or trainer.devices.
            allow_tp_across_nodes: accept TP groups that span nodes (slow: TP all-reduces leave NVLink).
            sequence_parallel: Megatron sequence parallelism (needs tensor_parallel > 1, seq_len divisible by it):
                LayerNorm/dropout/residual activations sharded along the sequence over the TP group.
            deepspeed_config: extra DeepSpeed config merged over the generated one (e.g. ZeRO bucket sizes).
            print_layout: rank 0 prints the rank -> node / (pp, dp, tp) / groups table at start-up.
            process_group_backend: default nccl on CUDA, gloo on CPU.
        """
        super().__init__()
        self.tensor_parallel, self.pipeline_parallel, self.zero_stage = tensor_parallel, pipeline_parallel, zero_stage
        self.pipeline_schedule = pipeline_schedule
        self.virtual_pipeline_stages = virtual_pipeline_stages or (2 if pipeline_schedule in MULTI_STAGE else 1)
        self.first_stage_layers, self.last_stage_layers = first_stage_layers, last_stage_layers
        self.pipeline: PipelineRunner | None = None
        self.gpus_per_node, self.allow_tp_across_nodes = gpus_per_node, allow_tp_across_nodes
        self.sequence_parallel = sequence_parallel
        self.extra_deepspeed_config = deepspeed_config or {}
        self.print_layout = print_layout
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.layout: ParallelLayout | None = None
        self.groups: ProcessGroups | None = None
        self.engine = None  # the DeepSpeed engine when zero_stage >= 1
        self._engine_stepped = False
        self.num_nodes = 1

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning reads this for custom strategies: `sync_dist=True` logging then reduces

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards and the engine must exist before states are loaded into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores model and optimizer shards itself

    @property
    def data_parallel_rank(self) -> int:
        return self.groups.data_parallel_rank if self.groups else self.global_rank

    @property
    def data_parallel_size(self) -> int:
        return self.groups.data_parallel_size if self.groups else self.world_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def _check_arguments(self) -> None:
        # Here rather than in __init__: the CLI's argument parser would bury the message in its own report.
        if self.zero_stage not in (0, 1, 2, 3):
            raise MTNLGError(f"zero_stage {self.zero_stage} is not one of 0 (plain DP), 1, 2, 3")
        schedule_class(self.pipeline_schedule)  # unknown names fail here with the list of known ones
        multi = self.pipeline_schedule in MULTI_STAGE
        if multi != (self.virtual_pipeline_stages > 1):
            raise MTNLGError(
                f"pipeline_schedule {self.pipeline_schedule} takes "
                f"{'2 or more' if multi else '1'} virtual_pipeline_stages, got {self.virtual_pipeline_stages}"
            )
        if self.pipeline_parallel > 1 and self.zero_stage == 3:
            raise MTNLGError(
                "zero_stage 3 partitions parameters a pipeline stage needs whole: use zero_stage 1 or "
                "2 with pipeline_parallel > 1"
            )
        if self.pipeline_schedule in V_SHAPED and self.zero_stage == 2:
            raise MTNLGError(
                f"pipeline_schedule {self.pipeline_schedule} splits the backward in two, which ZeRO-2's "
                f"gradient bookkeeping does not follow: use zero_stage 0 or 1 with it"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise MTNLGError("sequence_parallel shards over the tensor-parallel group: it needs tensor_parallel > 1")

    def _configure_launcher(self) -> None:
        self._check_arguments()
        if not self.cluster_environment.creates_processes_externally:
            # Lightning will spawn the ranks: check the layout first, so a bad one is one line from one process.
            ParallelLayout(
                self.num_nodes * self.num_processes,
                self.tensor_parallel,
                self.pipeline_parallel,
                self.gpus_per_node or self.num_processes or None,
                self.allow_tp_across_nodes,
            )
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        self._check_arguments()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # Validate before any collective: every rank fails the same way, at once, with one line.
        self.layout = self._build_layout()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.groups = ProcessGroups.create(self.layout, backend=backend)
        if self.print_layout:
            rank_zero_info(self.layout.table())

    def _build_layout(self) -> ParallelLayout:
        gpus_per_node = self.gpus_per_node or gpus_per_node_from_env(self.num_processes or None)
        layout = ParallelLayout(
            self.world_size, self.tensor_parallel, self.pipeline_parallel, gpus_per_node, self.allow_tp_across_nodes
        )
        config = getattr(self.lightning_module, "config", None)
        if config is not None:
            layout.validate_model(config.num_heads, config.padded_vocab_size(), config.num_layers)
            if self.sequence_parallel:
                check_sequence_length(config.seq_len, self.tensor_parallel)
            stages = self.pipeline_parallel * self.virtual_pipeline_stages
            layers_per_stage(config.num_layers, stages, self.first_stage_layers, self.last_stage_layers)
        return layout

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        groups = self.groups
        if not getattr(module, "_mtnlg_parallelized", False):
            stage_models = self._split_pipeline(module.model)
            for stage_model in stage_models:
                parallelize(
                    stage_model,
                    groups.tensor_parallel_group,
                    groups.tensor_parallel_rank,
                    groups.tensor_parallel_size,
                    sequence_parallel=self.sequence_parallel,
                )
            if groups.tensor_parallel_size > 1:
                module.loss_fn = VocabParallelCrossEntropy(groups.tensor_parallel_group)
            if self.pipeline_parallel > 1:
                self.pipeline.tied = self._tied_embedding(stage_models)  # after TP sharding: the final tensors
                module.model = stage_models[0] if len(stage_models) == 1 else PipelineChunks(stage_models)
            module._mtnlg_parallelized = True
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if self.zero_stage >= 1:
                config = deepspeed_config(
                    self.zero_stage,
                    module.micro_batch_size,
                    module.grad_clip,
                    str(trainer.precision),
                    self.extra_deepspeed_config,
                    shard_numel=sum(p.numel() for p in module.model.parameters()),
                )
                self.engine = initialize_engine(module.model, self.optimizers[0], config, ModelParallelUnit(groups))
                self.optimizers = [self.engine.optimizer]
            if self.pipeline is not None and self.zero_stage == 2:
                self.pipeline.backward_context = lambda: engine_backward(self.engine)
        self.setup_precision_plugin()

    def _split_pipeline(self, model) -> list:
        """This rank's pipeline stage models (the model itself without pipelining) and the schedule runner."""
        if self.pipeline_parallel == 1:
            return [model]
        groups, layout = self.groups, self.layout
        models, indices, _ = split_into_stages(
            model,
            self.pipeline_parallel,
            groups.pipeline_parallel_rank,
            self.pipeline_schedule,
            self.virtual_pipeline_stages,
            self.first_stage_layers,
            self.last_stage_layers,
        )
        num_stages = self.pipeline_parallel * self.virtual_pipeline_stages
        firsts = [m for m in models if m.embed is not None]
        lasts = [m for m in models if m.lm_head is not None]
        placement = stage_ranks(self.pipeline_schedule, self.pipeline_parallel, self.virtual_pipeline_stages)
        last_pp = next(r for r, stages in enumerate(placement) if num_stages - 1 in stages)
        c = groups.coord
        self.pipeline = PipelineRunner(
            models,
            indices,
            num_stages,
            self.pipeline_schedule,
            self.root_device,
            groups.pipeline_parallel_group,
            layout.rank(last_pp, c.dp, c.tp),
            is_first=bool(firsts),
            is_last=bool(lasts),
        )
        return models

    def _tied_embedding(self, stage_models) -> TiedEmbedding | None:
        """The link between the word embedding (first stage) and the LM-head copy (last stage) of this rank's
        (dp, tp) coordinates; None when this rank holds neither end or both (V-shaped schedules)."""
        group, first_rank, last_rank = create_embedding_group(
            self.layout, self.pipeline_schedule, self.virtual_pipeline_stages, self.groups.rank
        )
        if group is None:
            return None
        firsts = [m for m in stage_models if m.embed is not None]
        lasts = [m for m in stage_models if m.lm_head is not None]
        weight = firsts[0].embed.wte.weight if firsts else lasts[0].lm_head.weight
        return TiedEmbedding(group, first_rank, last_rank, weight, is_first=bool(firsts))

    def _add_to_embedding_grad(self, grad: torch.Tensor) -> None:
        """The last stage's LM-head gradient joins the word embedding's (before the DP reduction and clipping)."""
        weight = self.pipeline.tied.weight
        if self.engine is not None and self.zero_stage == 2:  # ZeRO-2 takes gradients in its backward hooks
            with engine_backward(self.engine):
                torch.autograd.backward((weight * grad).sum())
        elif weight.grad is None:
            weight.grad = grad.clone()
        else:
            weight.grad.add_(grad)

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Logged values (`sync_dist=True`): the mean over the world. TP ranks hold the same loss, so this is
        the mean over the data-parallel replicas; rank 0 logs it once."""
        if not isinstance(tensor, torch.Tensor) or not _distributed_is_initialized():
            return tensor
        from lightning.fabric.utilities.distributed import _sync_ddp

        return _sync_ddp(tensor, group, reduce_op=reduce_op)

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ the training step (called by the module)
    def forward_backward(self, module, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's micro-batches: forward, loss, backward (through the engine under ZeRO); mean loss.
        With pipelining the schedule runs them (Lightning's backward is not used) and the loss, computed on the
        last stage, is broadcast along the pipeline."""
        if self.pipeline is not None:
            return self.pipeline.run(
                tokens,
                module.micro_batch_size,
                module.loss_fn,
                train=True,
                add_to_embedding_grad=self._add_to_embedding_grad,
            )
        forward = self.engine if self.engine is not None else module.model
        chunks = tokens.split(module.micro_batch_size)
        total = torch.zeros((), device=tokens.device)
        for chunk in chunks:
            loss = module.loss_fn(forward(chunk[:, :-1]), chunk[:, 1:])
            module.manual_backward(loss / len(chunks))
            total += loss.detach()
        return total / len(chunks)

    def forward_only(self, module, tokens: torch.Tensor) -> torch.Tensor:
        """Validation/test loss: through the pipeline schedule (forward only) when pipelined."""
        if self.pipeline is None:
            return module.mean_micro_batch_loss(tokens)
        return self.pipeline.run(tokens, module.micro_batch_size, module.loss_fn, train=False)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.engine is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.engine.backward(closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def clip_and_step(self, module, optimizer, loss: torch.Tensor) -> torch.Tensor:
        """DP-reduce, clip by the global norm (TP shards counted once each), update unless vetoed; pre-clip norm."""
        if self.engine is not None:
            can_veto = any(hasattr(cb, "should_skip_update") for cb in self.lightning_module.trainer.callbacks)
            snapshot = UpdateSnapshot(module.model, self.engine.optimizer) if can_veto else None
            self.engine.step()  # DP reduction, clipping by the global norm, update, zero_grad
            grad_norm = torch.tensor(float(self.engine.get_global_grad_norm()), device=loss.device)
            if snapshot is not None and module.should_skip_update(loss, grad_norm):
                snapshot.restore()  # the module counts the vetoed step
            else:
                self._engine_stepped = True
                optimizer.step()  # Lightning counts the step; optimizer_step sees the engine already stepped
            self._sync_tied_embedding()
            return grad_norm
        params = [p for p in module.model.parameters() if p.grad is not None]
        self._all_reduce_data_parallel_grads(params)
        grad_norm = self._global_grad_norm(params)
        if module.grad_clip:
            coef = module.grad_clip / (grad_norm + 1e-6)
            if coef < 1:
                torch._foreach_mul_([p.grad for p in params], coef)
        if not module.should_skip_update(loss, grad_norm):  # a vetoed step is counted by the module
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._sync_tied_embedding()
        return grad_norm

    def _sync_tied_embedding(self) -> None:
        """After every update (and checkpoint load) the last stage's LM head receives the updated embedding, so
        the two copies are bit-identical between steps, as Megatron keeps them."""
        if self.pipeline is not None and self.pipeline.tied is not None:
            self.pipeline.tied.broadcast_weight()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Under ZeRO the engine steps (Lightning's step counting happens around this call)."""
        if self.engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure()
        if not self._engine_stepped:
            self.engine.step()
        self._engine_stepped = False
        return None

    def _all_reduce_data_parallel_grads(self, params) -> None:
        if self.groups.data_parallel_size == 1 or not params:
            return
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.groups.data_parallel_group)
        flat /= self.groups.data_parallel_size
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)

    def _global_grad_norm(self, params) -> torch.Tensor:
        """L2 norm over the whole model: shards from every TP rank, replicated params once (on TP rank 0)."""
        first_tp = self.groups.tensor_parallel_rank == 0
        counted = [p.grad for p in params if is_tensor_parallel(p) or first_tp]
        device = params[0].device if params else self.root_device
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for grad in counted:
            sq += grad.detach().double().pow(2).sum()
        if self.groups.layout.model_parallel > 1:
            dist.all_reduce(sq, group=self.groups.model_parallel_group)
        return sq.sqrt().float()

    # ------------------------------------------------------------------ gathered view (tests, export)
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (ZeRO-3 partitions and TP shards gathered), on every rank."""
        model = self.lightning_module.model
        params = dict(model.named_parameters())
        context = nullcontext()
        if self.engine is not None and self.zero_stage == 3:
            import deepspeed

            context = deepspeed.zero.GatheredParameters(list(params.values()))
        out = {}
        with context:
            for name, p in params.items():
                value = p.detach().clone()
                if is_tensor_parallel(p) and self.groups.tensor_parallel_size > 1:
                    value = gather_tensor_parallel(value, p.partition_dim, self.groups.tensor_parallel_group)
                if isinstance(model, PipelineChunks):
                    name = name.split(".", 1)[1]  # "<chunk>.blocks.7.x" -> "blocks.7.x" (block names are global)
                out[name] = value
        if self.pipeline_parallel > 1:  # every stage's parameters, on every rank
            parts = [None] * self.pipeline_parallel
            dist.all_gather_object(
                parts, {k: v.cpu() for k, v in out.items()}, group=self.groups.pipeline_parallel_group
            )
            out = {k: v.to(self.root_device) for part in parts for k, v in part.items()}
        return out

    @torch.no_grad()
    def tied_head_copy(self) -> torch.Tensor | None:
        """The last stage's copy of the word embedding (TP-gathered), on every rank; None without a cross-rank tie."""
        tied = self.pipeline.tied if self.pipeline is not None else None
        copy_ = None
        if tied is not None and not tied.is_first:
            copy_ = tied.weight.detach().clone()
            if self.groups.tensor_parallel_size > 1:
                copy_ = gather_tensor_parallel(copy_, 0, self.groups.tensor_parallel_group)
            copy_ = copy_.cpu()
        parts = [None] * self.world_size
        dist.all_gather_object(parts, copy_)
        found = [part for part in parts if part is not None]
        return found[0].to(self.root_device) if found else None

    # ------------------------------------------------------------------ checkpoints: one folder, this layout
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # shards are written by save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A folder: DeepSpeed's own files under ZeRO, else one `rank_XXXXX.pt` shard per rank; Lightning's
        loop/scheduler/callback state and `consumed_samples` in `meta.pt` (or DeepSpeed's client state)."""
        path = Path(self.broadcast(str(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.engine is not None:
            self.engine.save_checkpoint(str(path), client_state=meta, tag="checkpoint")
        else:
            if self.is_global_zero:
                if path.is_file():
                    path.unlink()
                path.mkdir(parents=True, exist_ok=True)
                torch.save(meta, path / _META_FILE)
            self.barrier()
            module = self.lightning_module
            torch.save(
                {"model": module.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers]},
                path / f"rank_{self.global_rank:05d}.pt",
            )
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.engine is not None:
            _, client_state = self.engine.load_checkpoint(
                str(path),
                tag="checkpoint",
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
                load_module_strict=True,
            )
            if client_state is None:
                raise MTNLGError(f"{path} holds no DeepSpeed checkpoint of this layout")
            self._sync_tied_embedding()
            return client_state
        shard_file = path / f"rank_{self.global_rank:05d}.pt"
        if not shard_file.exists():
            raise MTNLGError(f"{path} has no shard for rank {self.global_rank} (saved with another layout?)")
        shard = torch.load(shard_file, map_location=self.root_device, weights_only=False)
        self.lightning_module.model.load_state_dict(shard["model"])
        for optimizer, state in zip(self.optimizers, shard["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        self._sync_tied_embedding()
        return torch.load(path / _META_FILE, map_location="cpu", weights_only=False)
