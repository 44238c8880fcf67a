"""Peak memory of this process over one training step: the figure that says whether a layout fits.

GPU: `torch.cuda.max_memory_allocated` (tensors the caching allocator handed out), its peak reset at every step
start. CPU: the peak resident set size (VmHWM in /proc/self/status), reset at every step start by writing "5" to
/proc/self/clear_refs (Linux >= 4.0); where that is not allowed the figure is the peak since the process started
(`resource.getrusage`), which still bounds the step's peak from above.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class StepPeakMemory:
    """`reset()` at a step start, `read_bytes()` at its end."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.per_step = True  # False once a CPU reset was refused: the figure is then the process-lifetime peak

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.per_step:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.per_step = False

    def read_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (since the last clear_refs reset on Linux)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
