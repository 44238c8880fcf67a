"""`heartbeat(phase, what)`: code outside the training loop's hooks tells the hang watchdog of this process (if one
is running) that `phase` starts now. `what` names work of its own size inside the phase, learned apart from the
phase's usual intervals (`phase_limits.py`): a downstream evaluation between two steps, a loss-spike rewind's
checkpoint load, the wait for a background checkpoint write. Without it that work would be judged by the limit
learned from much shorter intervals, and a healthy run ended as hung.

No imports from the package: the checkpoint and evaluation code calls it without depending on the watchdog."""

from __future__ import annotations

_running: list = []  # the watchdog of the fit in progress in this process (at most one)


def heartbeat(phase: str, what: str | None = None) -> None:
    for watchdog in _running:
        watchdog.beat(phase, what=what)


def watch(watchdog) -> None:
    if watchdog not in _running:
        _running.append(watchdog)


def unwatch(watchdog) -> None:
    if watchdog in _running:
        _running.remove(watchdog)
