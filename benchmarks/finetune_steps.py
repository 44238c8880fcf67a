"""What every fine-tuning benchmark worker records, whichever trainer it runs: the wall-clock start of each optimizer
step, the batch it consumed, the end of the last step, and the training's peak memory.

A step's time is the interval between consecutive step starts (data loading, forward, backward, clipping, the
update and the trainer's own bookkeeping all included), so every trainer is timed the same way: on the wall clock,
and in CPU time of the process (`time.process_time`: on a shared CPU the work done, not the wait for a core; with
one torch thread it is the fairer figure there). Its tokens:
- `positions`: what the model computed on (rows x row length, padding included; a padding-free batch has none);
- `tokens`: the documents' own tokens (non-padding);
- `trained`: the positions with a label (the assistant's tokens);
- `examples`: the documents (a packed row holds several; a padded row one).

Plain Python and torch only: the litgpt worker imports it from its own virtual environment.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from mtnlg_lightning.outputs import write_json
from mtnlg_lightning.train.peak_memory import StepPeakMemory

IGNORE_INDEX = -100


@dataclass
class StepLog:
    device: str
    starts: list[float] = field(default_factory=list)
    cpu_starts: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    examples: list[int] = field(default_factory=list)
    end: float | None = None
    cpu_end: float | None = None
    peak_memory_bytes: int = 0
    memory_at_start_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self._peak = StepPeakMemory(torch.device(self.device))

    def start_memory(self) -> None:
        """The peak counts from here (after the model and data are built); what is held now is noted."""
        self.memory_at_start_bytes = memory_now(self.device)
        self._peak.reset()

    def read_memory(self) -> None:
        """Fold the peak so far in (our module resets the CPU peak at every step start: read at every step end)."""
        self.peak_memory_bytes = max(self.peak_memory_bytes, self._peak.read_bytes())

    def step(self, rows: int, positions: int, tokens: int, trained: int, examples: int | None = None) -> None:
        """A step starts on a batch: `examples` defaults to `rows` (one example a row)."""
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.rows.append(int(rows))
        self.positions.append(int(positions))
        self.tokens.append(int(tokens))
        self.trained.append(int(trained))
        self.examples.append(int(rows if examples is None else examples))

    def finish(self) -> None:
        self.end = time.perf_counter()
        self.cpu_end = time.process_time()
        self.read_memory()

    def write(self, path: str | os.PathLike) -> None:
        write_json(path, asdict(self))


def memory_now(device: str) -> int:
    """Bytes held now: the CUDA allocator's tensors on a GPU, the resident set size on a CPU."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(torch.device(device))
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024  # kB


def labelled(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


def rates(log: dict, warmup: int) -> dict:
    """Per-second figures over the steps after `warmup` (sums over the measured steps / their wall time, and / their
    CPU time: `*_per_s`, `*_per_cpu_s`)."""
    measured = range(warmup, len(log["starts"]))
    if not measured:
        raise ValueError(f"no step after the {warmup} warm-up steps ({len(log['starts'])} steps run)")
    seconds = log["end"] - log["starts"][warmup]
    cpu_seconds = log["cpu_end"] - log["cpu_starts"][warmup]
    counted = ("rows", "positions", "tokens", "trained", "examples")
    sums = {key: sum(log[key][i] for i in measured) for key in counted}
    return {
        "steps": len(measured),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "step_s": seconds / len(measured),
        "step_cpu_s": cpu_seconds / len(measured),
        **{f"{key}_per_s": value / seconds for key, value in sums.items()},
        **{f"{key}_per_cpu_s": value / cpu_seconds for key, value in sums.items()},
        "token_share": sums["tokens"] / max(1, sums["positions"]),
        "trained_share": sums["trained"] / max(1, sums["positions"]),
    }
