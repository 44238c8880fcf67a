"""The suite's time budget per test file, a pytest plugin (tests/conftest.py registers it).

It sums each test file's durations (setup + call + teardown of every test, from the reports pytest-xdist's workers
send to the controller, so `-n 2 --dist loadfile` counts as one process would), prints the 10 slowest files, and
fails the session (exit status 1, one line per file naming it, its seconds and the budget) when a file took longer
than its budget.

The budget: BUDGET_S (900 s) per file, `MTNLG_FILE_BUDGET_S` to change it (0: no budget). Why 900 s: the slowest
file, tests/test_resilience.py, took about 6 to 7 minutes of the 24-minute suite on the 2-core CI machine (2026-12-06:
its three launcher drills 192 + 88 + 79 s, its reference run and the rest), and 497 to 559 s of its drills alone
with a CPU hog on both cores (`scripts/test.sh --under-load`); 900 s stays above a loaded machine's figure, so a red
run means a file grew, not a busy machine. Under `--dist loadfile` one worker runs a whole file, so a file much
longer than that would set the suite's wall time by itself: split it, or share its launches.

When it is checked: only when pytest was given no test paths or node ids and no `-k` (the whole suite, or a lane of
it chosen with `-m`, e.g. the fast lane: its files' totals can only be smaller). A run of a few files or tests, like
`scripts/test.sh --under-load`, prints the table but is not judged: a file's total is then not the suite's.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

BUDGET_S = 900.0
BUDGET_ENV = "MTNLG_FILE_BUDGET_S"
SHOWN = 10


class SuiteBudget:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.seconds: dict[str, float] = defaultdict(float)
        self.budget_s = float(os.environ.get(BUDGET_ENV) or BUDGET_S)
        self.over: list[tuple[str, float]] = []

    def checked(self) -> bool:
        explicit = self.config.args_source == pytest.Config.ArgsSource.ARGS
        return self.budget_s > 0 and not explicit and not self.config.option.keyword

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.checked():
            return
        self.over = [(path, total) for path, total in self.slowest(len(self.seconds)) if total > self.budget_s]
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def slowest(self, count: int) -> list[tuple[str, float]]:
        return sorted(self.seconds.items(), key=lambda item: -item[1])[:count]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        rule = f"budget {self.budget_s:g} s per file ({BUDGET_ENV})" if self.checked() else "budget not checked"
        terminalreporter.write_sep("=", f"slowest {SHOWN} test files (setup + call + teardown); {rule}")
        for path, total in self.slowest(SHOWN):
            terminalreporter.write_line(f"{total:9.2f}s  {path}")
        for path, total in self.over:
            terminalreporter.write_line(
                f"suite budget: {path} took {total:.1f} s, over the budget of {self.budget_s:g} s per file "
                f"({BUDGET_ENV}, testing/suite_budget.py)",
                red=True,
                bold=True,
            )


def register(config: pytest.Config) -> None:
    """On the process that reports (not on a pytest-xdist worker: the controller gets every worker's reports)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteBudget(config), "mtnlg_suite_budget")
