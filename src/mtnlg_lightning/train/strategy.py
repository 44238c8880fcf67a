"""The Lightning Strategy: a thin adapter wiring the layout, tensor parallelism and ZeRO into Lightning's loop.

    trainer:
      strategy:
        class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy
        init_args: {tensor_parallel: 2, zero_stage: 1}

The layout's arguments become one `parallel.config.ParallelConfig` (the dry run, the planner and inference read
strategy files into the same one). At start-up every rank builds the same `ParallelLayout` (pp, dp, tp; TP
innermost) by validating that config against the model and the world, creates its process groups and rank 0
prints the table. `setup` applies the layout (`parallelize_gpt`) and either keeps the module's optimizer with a
plain DP all-reduce (`zero_stage: 0`) or hands model shard + optimizer to DeepSpeed ZeRO over the DP group (1, 2,
3). The module owns the training step; this class supplies its parts (`step_interfaces`: forward_backward,
evaluate, update). Works under Lightning's launcher, torchrun and SLURM (Lightning's cluster environments).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from mtnlg_lightning.checkpoint.async_save import BackgroundSaver
from mtnlg_lightning.checkpoint.commit import remove_checkpoint
from mtnlg_lightning.checkpoint.sharded import load_sharded, save_sharded
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.parallel.clip import clip_grad_norm_
from mtnlg_lightning.parallel.config import ParallelConfig, PipelineParallelSettings
from mtnlg_lightning.parallel.deepspeed_compat import engine_backward
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups, gpus_per_node_from_env
from mtnlg_lightning.parallel.output_layer import heads_in_loss
from mtnlg_lightning.parallel.parallelize import ParallelGPT, parallelize_gpt
from mtnlg_lightning.parallel.pipeline import PipelineRunner
from mtnlg_lightning.parallel.tied_embedding import TiedEmbedding
from mtnlg_lightning.parallel.zero import (
    ModelParallelUnit,
    build_deepspeed_config,
    engine_update,
    initialize_engine,
)
from mtnlg_lightning.resilience.restart import process_group_store
from mtnlg_lightning.resilience.watchdog import keep_own_timeout, save_collective_timeout, startup_collective_timeout
from mtnlg_lightning.train import lightning_compat
from mtnlg_lightning.train.step_interfaces import (
    RowWidths,
    Update,
    accumulate,
    count_micro_batches,
    evaluate,
    optimizer_update,
)


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
        context_parallel: int = 1,
        context_parallel_kernel: str = "auto",
        deepspeed_config: dict | None = None,
        print_layout: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        async_save: bool = False,
        expert_parallel: int = 1,
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
            context_parallel: ranks that split each sequence (`parallel/context_parallel.py`: 2 x CP chunks, rank r
                holding chunks r and 2CP-1-r; ring attention over the whole sequence); seq_len divisible by 2 x CP.
                Placed after TP, before DP; gradients are averaged and ZeRO partitions over DP x CP.
            context_parallel_kernel: the ring's block attention: auto (flash on CPU and on CUDA in bf16/fp16,
                memory-efficient on CUDA in fp32), flash, efficient; it must return its log-sum-exp.
            deepspeed_config: extra DeepSpeed config merged over the generated one (e.g. ZeRO bucket sizes).
            print_layout: rank 0 prints the rank -> node / (pp, dp, tp) / groups table at start-up.
            process_group_backend: default nccl on CUDA, gloo on CPU.
            timeout: collective timeout of the process groups at initialisation; default: the hang watchdog's
                startup limit. While fitting, `resilience.watchdog.HangWatchdog` sets it to the limit of each phase
                (+30 s): the step limit after the first step, the save and eval limits for those.
            async_save: checkpoints are copied to host memory at the save and written in the background while
                training goes on (`checkpoint/async_save.py`); at most one save in flight; published only complete.
            expert_parallel: data-parallel ranks that split each mixture-of-experts layer's experts (E / EP each;
                tokens travel to their experts by all-to-all); it divides the data-parallel size. Expert gradients
                are averaged over the ranks holding the same experts; under ZeRO their optimizer state (ZeRO-3:
                the experts themselves) is partitioned over those ranks. Composes with TP, SP, CP, PP and ZeRO 0-3.
        """
        super().__init__()
        # Checked later (`_check_arguments`): the CLI's argument parser would bury a message raised here.
        self.parallel_config = ParallelConfig(
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            pipeline_schedule=pipeline_schedule,
            virtual_pipeline_stages=virtual_pipeline_stages,
            first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            context_parallel=context_parallel,
            context_parallel_kernel=context_parallel_kernel,
            expert_parallel=expert_parallel,
            gpus_per_node=gpus_per_node,
            allow_tp_across_nodes=allow_tp_across_nodes,
        )
        self.parallel: ParallelGPT | None = None  # this rank's model part, set once by setup
        self.extra_deepspeed_config = deepspeed_config or {}
        self.print_layout = print_layout
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.async_save = async_save
        self.background_saver: BackgroundSaver | None = None
        self.layout: ParallelLayout | None = None
        self.widths = RowWidths()  # how wide micro-batches of rows are computed
        self.groups: ProcessGroups | None = None
        self.engine = None  # the DeepSpeed engine when zero_stage >= 1
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

    # ------------------------------------------------------------------ the layout (`self.parallel_config`)
    @property
    def pipeline_parallel(self) -> int:
        return self.parallel_config.pipeline_parallel

    @property
    def context_parallel_kernel(self) -> str:
        return self.parallel_config.context_parallel_kernel

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel_config.sequence_parallel

    @property
    def zero_stage(self) -> int:
        return self.parallel_config.zero_stage

    def _check_arguments(self, world_size: int | None = None, gpus_per_node: int | None = None) -> None:
        # Here rather than in __init__: the CLI's argument parser would bury the message in its own report.
        self.parallel_config.validate(world_size=world_size, gpus_per_node=gpus_per_node)
        if self.zero_stage >= 1:  # before any process is launched or data is built
            require_extra("deepspeed", f"zero_stage {self.zero_stage} (DeepSpeed ZeRO; zero_stage 0 does without it)")

    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            self._check_arguments()
            return
        # Lightning will spawn the ranks: check the layout first, so a bad one is one line from one process.
        self._check_arguments(self.num_nodes * self.num_processes, self.num_processes or None)
        lightning_compat.use_subprocess_launcher(self)

    def setup_environment(self) -> None:
        self._check_arguments()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # Validate before any collective: every rank fails the same way, at once, with one line.
        self.layout = self._build_layout()
        backend = self._process_group_backend or lightning_compat.default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        timeout = self._timeout or startup_collective_timeout()
        # A fresh key namespace per torchrun attempt: restarts never read a dead peer's address.
        kwargs: dict[str, Any] = {"timeout": timeout, **process_group_store(timeout)}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        lightning_compat.init_process_group(self.cluster_environment, backend, **kwargs)
        self.groups = ProcessGroups.create(self.layout, backend=backend)
        if self.async_save:  # its own group: the writer thread's collectives never meet the training's
            group = dist.new_group(backend="gloo", timeout=save_collective_timeout())
            keep_own_timeout(group)  # it waits for the slowest rank's write, while the steps have shorter limits
            self.background_saver = BackgroundSaver(group)
        if self.print_layout:
            rank_zero_info(self.layout.table())

    def _build_layout(self) -> ParallelLayout:
        gpus_per_node = gpus_per_node_from_env(self.num_processes or None)
        config = getattr(self.lightning_module, "config", None)  # the model, when the module has one to check
        return self.parallel_config.validate(config, self.world_size, gpus_per_node=gpus_per_node)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        if self.parallel is None:
            self.parallel = parallelize_gpt(
                module.model,
                self.groups,
                self.root_device,
                self.pipeline_settings,
                self.sequence_parallel,
                self.context_parallel_kernel,
                **module.model_transforms(),
            )
            # before a checkpoint is restored into the model
            module.on_layout_applied(self.parallel.model, self.parallel.loss_fn)
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            lightning_compat.reset_optimizers_and_schedulers(self)
            self.setup_optimizers(trainer)
            if self.zero_stage >= 1:
                config = build_deepspeed_config(
                    self.zero_stage,
                    module.micro_batch_size,
                    module.grad_clip,
                    str(trainer.precision),
                    self.extra_deepspeed_config,
                    shard_numel=sum(p.numel() for p in module.model.parameters()),
                )
                self.engine = initialize_engine(
                    module.model, self.optimizers[0], config, ModelParallelUnit(self.groups)
                )
                self.optimizers = [self.engine.optimizer]
                if self.tied_embedding is not None:
                    self.tied_embedding.use_engine(self.engine)
            if self.pipeline is not None and self.zero_stage == 2:
                self.pipeline.backward_context = lambda: engine_backward(self.engine)
        self.setup_precision_plugin()

    @property
    def pipeline(self) -> PipelineRunner | None:
        return self.parallel.pipeline if self.parallel is not None else None

    @property
    def tied_embedding(self) -> TiedEmbedding | None:
        return self.parallel.tied_embedding if self.parallel is not None else None

    @property
    def pipeline_settings(self) -> PipelineParallelSettings:
        return self.parallel_config.pipeline

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def barrier(self, name: str | None = None) -> None:
        if lightning_compat.distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not lightning_compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Logged values (`sync_dist=True`): the mean over the world. TP ranks hold the same loss, so this is
        the mean over the data-parallel replicas; rank 0 logs it once."""
        if not isinstance(tensor, torch.Tensor) or not lightning_compat.distributed_is_initialized():
            return tensor
        return lightning_compat.sync_ddp(tensor, group, reduce_op)

    def teardown(self) -> None:
        if self.background_saver is not None:
            self.background_saver.wait()  # the last save is published before fit returns
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ the step's parts (step_interfaces.py)
    def forward_backward(self, batch: dict, micro_batch_size: int, step_loss) -> torch.Tensor:
        """Accumulate this rank's micro-batches: through the pipeline schedule (Lightning's backward unused; the
        loss, computed on the last stage, broadcast along the pipeline), else one by one (through the engine under
        ZeRO)."""
        self.widths.note(batch, self.lightning_module.config, self.pipeline is not None)
        with heads_in_loss(self.lightning_module.model):  # the layout's loss applies the LM head (output_layer)
            if self.pipeline is None:
                forward, multiple = self.forward_module, self.row_multiple
                return accumulate(forward, self._backward, batch, micro_batch_size, step_loss, row_multiple=multiple)
            loss_fn = self._pipeline_loss(batch, micro_batch_size, step_loss)
            loss = self.pipeline.run(batch, micro_batch_size, loss_fn)
        if self.tied_embedding is not None:
            self.tied_embedding.after_backward()
        return loss

    def evaluate(self, batch: dict, micro_batch_size: int, step_loss) -> torch.Tensor:
        self.widths.note(batch, self.lightning_module.config, self.pipeline is not None)
        with heads_in_loss(self.lightning_module.model):
            if self.pipeline is None:
                return evaluate(self.lightning_module.model, batch, micro_batch_size, step_loss, self.row_multiple)
            loss_fn = self._pipeline_loss(batch, micro_batch_size, step_loss)
            return self.pipeline.run(batch, micro_batch_size, loss_fn, train=False)

    @property
    def row_multiple(self) -> int | None:
        """What a micro-batch's width must be a multiple of: ROW_MULTIPLE and the cuts of sequence and context
        parallelism; None where the rows keep seq_len (`step_interfaces.RowWidths` says where: a pipeline, ...)."""
        return self.widths.multiple(
            self.lightning_module.config, self.pipeline is not None, self.parallel_config.sequence_multiple
        )

    @staticmethod
    def _pipeline_loss(batch: dict, micro_batch_size: int, step_loss):
        micro_batches = count_micro_batches(batch, micro_batch_size)
        return lambda output, labels: step_loss(output, labels) / micro_batches

    def _backward(self, loss: torch.Tensor) -> None:
        self.backward(loss, None)

    @property
    def forward_module(self) -> torch.nn.Module:
        """What runs a micro-batch forward on this rank: the engine under ZeRO, else the sharded model."""
        return self.engine if self.engine is not None else self.lightning_module.model

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.engine is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.engine.backward(closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def update(self, optimizer, max_norm: float | None, undoable: bool) -> Update:
        """Reduce over DP, clip by the global norm (TP shards counted once each, all stages); the update waits for
        the veto. ZeRO: the engine's one fused `step()` has applied it already (`zero.engine_update`; a snapshot
        taken when `undoable` restores it when vetoed); plain DP: one flat all-reduce and the clipping here, then
        the module's optimizer. Either way the last stage's LM-head copy then receives the (updated or unchanged)
        embedding."""
        model = self.lightning_module.model
        after = self.tied_embedding.after_update if self.tied_embedding is not None else None
        if self.engine is not None:
            grad_norm, snapshot = engine_update(self.engine, model, undoable, self.root_device)
            discard = snapshot.restore if snapshot is not None else _nothing
            return Update(grad_norm, apply=_nothing, discard=discard, after=after)
        grad_norm = clip_grad_norm_(list(model.parameters()), max_norm, self.groups, self.root_device)
        return optimizer_update(self, optimizer, grad_norm, after)

    # ------------------------------------------------------------------ checkpoints: model space, any layout
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # shards are written by save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """The layout-independent format (checkpoint/format.py): every rank writes its pieces, the manifest last."""
        save_sharded(self, checkpoint, Path(self.broadcast(str(filepath))), self.background_saver)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Any checkpoint of this format, whatever layout or ZeRO stage wrote it."""
        if self.background_saver is not None:
            self.background_saver.wait()
        state = load_sharded(self, Path(self.broadcast(str(checkpoint_path))))
        if self.tied_embedding is not None:
            self.tied_embedding.after_load()
        return state

    def remove_checkpoint(self, filepath) -> None:
        if self.background_saver is not None:  # keep-last-k: remove the older one only after the newer is published
            if self.is_global_zero:
                self.background_saver.after_publish(lambda: remove_checkpoint(filepath))
            return
        self.barrier()
        if self.is_global_zero:
            remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        if self.background_saver is not None:
            self.background_saver.abandon()  # the peers may be gone: never wait on the writer's collectives


def _nothing() -> None:  # the engine has applied the update already; without a snapshot there is nothing to undo
    return None
