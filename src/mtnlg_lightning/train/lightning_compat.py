"""Every private Lightning name the trainer relies on, reached through this one module.

Lightning offers no public way to write a custom multi-process strategy that starts its own process groups, to count
an optimizer step that its `LightningOptimizer` wrapper did not make, or to change how `ckpt_path="last"` is found.
These few names do it. `tests/test_framework_compat.py` lists them all (with who needs each) and checks them against
the installed Lightning: when a release moves one, it fails naming it and the file that needs it, and this module
is the only place to change (the version range that was checked is pinned in `pyproject.toml`).
"""

from __future__ import annotations

from lightning.fabric.utilities import distributed as _fabric_distributed
from lightning.pytorch.strategies.launchers import subprocess_script as _subprocess_script


def distributed_is_initialized() -> bool:
    return _fabric_distributed._distributed_is_initialized()


def default_process_group_backend(device) -> str:
    """nccl on CUDA devices, gloo elsewhere (Lightning's choice for its own strategies)."""
    return _fabric_distributed._get_default_process_group_backend_for_device(device)


def init_process_group(cluster_environment, backend: str, **kwargs) -> None:
    """torch.distributed's world from Lightning's cluster environment (address, port, ranks), as its strategies do."""
    _fabric_distributed._init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp(tensor, group, reduce_op):
    """All-reduce a logged value over `group` with Lightning's op names ("mean", "sum", ...)."""
    return _fabric_distributed._sync_ddp(tensor, group, reduce_op=reduce_op)


def use_subprocess_launcher(strategy) -> None:
    """Let Lightning start the strategy's local ranks as subprocesses of this script (`trainer.devices N`)."""
    strategy._launcher = _subprocess_script._SubprocessScriptLauncher(
        strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
    )


def reset_optimizers_and_schedulers(strategy) -> None:
    """Forget optimizers set up before (a second fit on the same strategy builds them again)."""
    strategy._reset_optimizers_and_schedulers()


def set_optimizer_steps(trainer, step: int) -> None:
    """Lightning's optimizer-step counter (`trainer.global_step` under manual optimization) set to `step`; the
    counter of this fit moves by the same amount, as Lightning's own increments do."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    delta = int(step) - progress.total.completed
    progress.total.ready = progress.total.completed = int(step)
    progress.current.ready = progress.current.completed = max(0, progress.current.completed + delta)


def strategy_of(module):
    """The strategy of the Trainer `module` is attached to, or None outside a Trainer (`LightningModule.trainer`
    raises there: a tool may build a module's model on its own)."""
    trainer = module._trainer
    return trainer.strategy if trainer is not None else None
