"""Per-rank model-state bytes read from the live objects: params, grads, fp32 master copy, Adam moments.

Design notes: docs/memory_accounting.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from lightning.pytorch.callbacks import Callback

from mtnlg_lightning.parallel.deepspeed_compat import local_partition
from mtnlg_lightning.parallel.zero import base_optimizer


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    master: int = 0
    moments: int = 0
    grads_at_update: int = 0  # transient: ZeRO re-flattens its gradient partition for the update (not counted)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.moments

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _tensors(obj, depth: int = 3):
    """Tensors inside obj, looking into lists, tuples and dict values (DeepSpeed keeps grads in nested ones)."""
    if torch.is_tensor(obj):
        yield obj
    elif depth and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif depth and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth - 1)


def _bytes(tensors, exclude_storages: set[int] = frozenset()) -> int:
    """Bytes covered by the tensors, overlapping views counted once. The tensors' own extents, not their whole
    storages: ZeRO's gradient views live in communication buckets, which are buffers, not model state."""
    spans = []
    for t in tensors:
        if t is None or t.numel() == 0 or t.untyped_storage().data_ptr() in exclude_storages:
            continue
        start = t.data_ptr()
        spans.append((start, start + t.numel() * t.element_size()))
    total, end = 0, 0
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _param_storage(p: torch.Tensor) -> torch.Tensor:
    return local_partition(p)  # ZeRO-3: this rank's partition


def _optimizer_params(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    # DeepSpeed ZeRO-3 empties the inner param_groups between its per-group steps: the state keys remain.
    params = [p for g in inner.param_groups for p in g["params"]]
    ids = {id(p) for p in params}
    return params + [p for p in inner.state if torch.is_tensor(p) and id(p) not in ids]


def grad_bytes(model: torch.nn.Module, optimizer) -> int:
    """Gradient bytes held right now: model .grads, the inner optimizer's param .grads, DeepSpeed's holders."""
    inner = base_optimizer(optimizer)
    tensors = [p.grad for p in model.parameters()]
    tensors += [p.grad for p in _optimizer_params(inner)]
    if inner is not optimizer:  # a ZeRO wrapper: every attribute that names a gradient buffer
        for name, value in vars(optimizer).items():
            if "grad" in name.lower() and "norm" not in name.lower():
                tensors += list(_tensors(value))
    return _bytes(tensors)


def state_bytes(model: torch.nn.Module, optimizer, grads: int | None = None) -> StateBytes:
    """This rank's model-state bytes now (`grads` overrides the gradient figure, e.g. with a sampled peak)."""
    inner = base_optimizer(optimizer)
    model_params = [_param_storage(p) for p in model.parameters()]
    params = _bytes(model_params)
    optimizer_params = _optimizer_params(inner)
    # The master copy is what the optimizer updates when that is not the model's own memory.
    master = _bytes(optimizer_params, exclude_storages={p.untyped_storage().data_ptr() for p in model_params})
    moments = _bytes(
        t for p in optimizer_params for t in inner.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0
    )
    return StateBytes(
        params=params, grads=grad_bytes(model, optimizer) if grads is None else grads, master=master, moments=moments
    )


class StateBytesProbe(Callback):
    """Reads this rank's model-state bytes on every training step; `result` is the last step's.

    Gradients are read after the backward (what ZeRO keeps between backward and update: full grads, or this
    rank's reduced partition) and, separately, at the inner optimizer's update (its step method is wrapped), where
    DeepSpeed holds a transient flattened copy per parameter group; the rest is read after the step, when Adam's
    moments exist and DeepSpeed has restored the full list of parameter groups (it steps them one at a time).
    """

    def __init__(self):
        self.result: StateBytes | None = None
        self._after_backward = 0
        self._at_update = 0
        self._wrapped = False

    @staticmethod
    def _model_and_optimizer(trainer, pl_module):
        engine = getattr(trainer.strategy, "engine", None)
        return pl_module.model, engine.optimizer if engine is not None else trainer.optimizers[0]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._after_backward = self._at_update = 0
        if not self._wrapped:
            model, optimizer = self._model_and_optimizer(trainer, pl_module)
            inner = base_optimizer(optimizer)
            original = inner.step

            def step(*args, **kwargs):
                self._at_update = max(self._at_update, grad_bytes(model, optimizer))
                return original(*args, **kwargs)

            inner.step = step
            self._wrapped = True

    def on_after_backward(self, trainer, pl_module):
        self._after_backward = max(self._after_backward, grad_bytes(*self._model_and_optimizer(trainer, pl_module)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        model, optimizer = self._model_and_optimizer(trainer, pl_module)
        self.result = state_bytes(model, optimizer, grads=self._after_backward)
        self.result.grads_at_update = self._at_update
