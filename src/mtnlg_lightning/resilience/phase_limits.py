"""How long each phase of a run may go without a heartbeat before the watchdog calls it a hang, learned from the run.

A phase starts from its cap (the configured limit, an environment override or the default) until it has been seen;
from then on its limit is SAFETY_FACTOR x the longest interval seen in it, never below the phase's floor and never
above the cap. A constant limit is either too long for a small model (a stop during a 1 s save sat 30 minutes) or
too short for a large one (a 530B save writes ~8.5 TB); NVIDIA's resiliency extension learns its timeouts the same
way (5 x the longest observed interval).

Intervals are keyed by phase, or by `phase:what` for work of another size inside a phase (a downstream evaluation
between steps is longer than one validation batch); a key takes its phase's cap and floor. The longest intervals
travel with the checkpoint (`state_dict`), so a restarted run starts with what the runs before it learned.
"""

from __future__ import annotations

import os

from mtnlg_lightning.errors import MTNLGError

PHASES = ("startup", "step", "data", "save", "eval")
# The caps, for GPU clusters: MT-NLG's step took ~30-60 s on 4,480 A100s; a 530B checkpoint with Adam state is
# ~8.5 TB, minutes on a parallel file system; start-up includes loading one.
DEFAULT_CAPS = {"startup": 1800.0, "step": 300.0, "data": 300.0, "save": 1800.0, "eval": 600.0}
# Below these a limit is not tightened: scheduling noise, a garbage collection or a file-system hiccup can stall a
# healthy rank for seconds. Start-up is the least regular phase (imports, rendezvous, kernel builds).
FLOORS = {"startup": 120.0, "step": 30.0, "data": 30.0, "save": 30.0, "eval": 30.0}
SAFETY_FACTOR = 5.0
ENV_VARS = {phase: f"MTNLG_{phase.upper()}_TIMEOUT" for phase in PHASES}


def resolve_limits(configured: dict[str, float]) -> dict[str, float]:
    """The configured limits with the environment's overrides; bad values are a configuration error."""
    limits = {}
    for phase, value in configured.items():
        raw = os.environ.get(ENV_VARS[phase], "")
        source = ENV_VARS[phase] if raw else f"{phase}_timeout"
        try:
            limits[phase] = float(raw) if raw else float(value)
        except ValueError:
            raise MTNLGError(f"{source} must be a number of seconds, got {raw!r}") from None
        if limits[phase] <= 0:
            raise MTNLGError(f"{source} must be > 0 seconds, got {limits[phase]:g}")
    return limits


def cap_source(phase: str, configured: float) -> str:
    if os.environ.get(ENV_VARS[phase]):
        return ENV_VARS[phase]
    return "default" if configured == DEFAULT_CAPS[phase] else f"{phase}_timeout"


# A start-up that resumes also reads a checkpoint (about what a save writes): until one has been seen, its limit
# is the start-up's plus the save's.
RESUMING_STARTUP = "startup:resuming"


def phase_of(key: str) -> str:
    return key.split(":", 1)[0]


class PhaseLimits:
    """The limit of every phase: its cap until seen, then learned from the longest interval seen (module doc)."""

    def __init__(
        self,
        configured: dict[str, float] | None = None,
        factor: float = SAFETY_FACTOR,
        floors: dict[str, float] | None = None,
    ):
        self.configured = {**DEFAULT_CAPS, **(configured or {})}
        if factor < 1:
            raise MTNLGError(f"the watchdog's safety factor must be >= 1, got {factor:g}")
        self.factor = factor
        unknown = sorted(set(floors or {}) - set(PHASES))
        if unknown:
            raise MTNLGError(f"the watchdog's floors name unknown phase(s) {unknown}: use {', '.join(PHASES)}")
        self.floors = {**FLOORS, **(floors or {})}
        self.caps = resolve_limits(self.configured)
        self.longest: dict[str, float] = {}  # key -> the longest interval seen (seconds)

    def reload_caps(self) -> None:
        """The caps from this process's environment (a restarted rank may be given other ones)."""
        self.caps = resolve_limits(self.configured)

    def observe(self, key: str, seconds: float) -> None:
        if seconds > self.longest.get(key, 0.0):
            self.longest[key] = seconds

    def limit(self, key: str) -> float:
        """Seconds the interval `key` may last."""
        phase = phase_of(key)
        cap = self.caps[phase]
        if key in self.longest:
            return min(cap, max(self.floors[phase], self.factor * self.longest[key]))
        if key == RESUMING_STARTUP and "startup" in self.longest:
            return min(cap, self.limit("startup") + self.limit("save"))
        return cap

    def how(self, key: str) -> str:
        """How `limit(key)` came about, for a diagnosis: 'learned: 5 x the longest save seen (2.41 s), ...'."""
        phase = phase_of(key)
        if key in self.longest:
            longest = self.longest[key]
            text = f"learned: {self.factor:g} x the longest {key} seen ({longest:.2f} s)"
            if self.factor * longest < self.floors[phase]:
                text += f", raised to the floor of {self.floors[phase]:g} s"
        elif key == RESUMING_STARTUP and "startup" in self.longest:
            text = (
                f"learned: the start-up limit ({self.limit('startup'):g} s) plus the save limit "
                f"({self.limit('save'):g} s) for the checkpoint it loads"
            )
        else:
            return "not seen yet in this run: the cap"
        return text + (", held at the cap" if self.limit(key) >= self.caps[phase] else "")

    def cap(self, key: str) -> str:
        """Where the cap of `key`'s phase comes from: 'cap 1800 s, the default (MTNLG_SAVE_TIMEOUT sets it)'."""
        phase = phase_of(key)
        source = cap_source(phase, self.configured[phase])
        if source == "default":
            return f"cap {self.caps[phase]:g} s, the default ({ENV_VARS[phase]} sets it)"
        return f"cap {self.caps[phase]:g} s from {source}"

    def summary(self) -> str:
        """One line: every phase's limit now and the longest interval it was learned from."""
        parts = []
        for key in sorted(self.longest.keys() | set(PHASES), key=lambda k: (PHASES.index(phase_of(k)), k)):
            seen = f"longest {self.longest[key]:.2f} s" if key in self.longest else "not seen: the cap"
            parts.append(f"{key} {self.limit(key):.0f} s ({seen})")
        return "; ".join(parts)

    def state_dict(self) -> dict:
        return {"longest": dict(self.longest), "factor": self.factor}

    def load_state_dict(self, state: dict) -> None:
        """Merge what an earlier run learned: the longest of each interval over both."""
        for key, seconds in (state or {}).get("longest", {}).items():
            if isinstance(seconds, (int, float)) and phase_of(key) in PHASES:
                self.observe(key, float(seconds))
