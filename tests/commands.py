"""Commands the tests run as a user would from a fresh shell: `python ARGS`, `mtnlg ARGS`, and rank launches, forked
from tests/zygote.py (which imported torch, Lightning, DeepSpeed and the trainer once) unless asked otherwise."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Set in this process by in-process Trainers with a process group (Lightning writes MASTER_PORT etc. into os.environ
# and keeps the store listening on that port): a command launched afterwards must not inherit them, as a user's
# fresh shell would not, or its ranks try to listen on the port this process still holds (EADDRINUSE).
RENDEZVOUS_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


def fresh_shell_environment(env: dict | None = None) -> dict:
    """This process's environment as a user's fresh shell would hand it to a command: no rendezvous variables,
    wandb offline, then `env`'s entries."""
    inherited = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    return {**inherited, "WANDB_MODE": "offline", **(env or {})}


class Zygote:
    """tests/zygote.py for this test process, started on first use: `python ARGS` forked from a process that
    imported torch, Lightning, DeepSpeed and the trainer once."""

    def __init__(self):
        fresh_path = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env=fresh_shell_environment(),
        ).stdout
        self.log = tempfile.NamedTemporaryFile(prefix="zygote-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=fresh_shell_environment({"ZYGOTE_FRESH_SYS_PATH": fresh_path}),
        )
        atexit.register(self.close)

    def run(self, argv: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="zygote-run-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = int(self.answer("pid", None))
            try:
                status = int(self.answer("exit", timeout))
            except subprocess.TimeoutExpired:
                os.killpg(pid, signal.SIGKILL)  # the command and every process it started
                self.answer("exit", None)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(
                argv, status, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def answer(self, kind: str, timeout: float | None) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(kind, timeout)
        line = self.process.stdout.readline()
        if not line.startswith(kind + " "):
            raise RuntimeError(f"tests/zygote.py ended or answered {line!r}; its log: {self.log.name}")
        return line.split()[1]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


ZYGOTES: list[Zygote] = []


def run_python(*args, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`python ARGS` run as a user would from a fresh shell (rendezvous variables dropped, wandb offline, `env`
    added), capturing its output, as `subprocess.run(..., capture_output=True, text=True)` would. The command is
    forked from tests/zygote.py, which imported the heavy modules once; an `env` that changes the interpreter's own
    start-up (PYTHON* variables), or MTNLG_TEST_ZYGOTE=0, takes a fresh interpreter instead."""
    argv = [str(arg) for arg in args]
    full_env = fresh_shell_environment(env)
    fresh = any(key.startswith("PYTHON") for key in env or {}) or os.environ.get("MTNLG_TEST_ZYGOTE") == "0"
    if fresh:
        command = [sys.executable, *argv]
        return subprocess.run(command, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if not ZYGOTES or ZYGOTES[0].process.poll() is not None:
        ZYGOTES[:] = [Zygote()]
    return ZYGOTES[0].run(argv, cwd or ROOT, full_env, timeout)


def run_cli(*args: str, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Run `mtnlg ARGS` as a user would from a fresh shell, capturing output."""
    return run_python("-m", "mtnlg_lightning.train.cli", *args, cwd=cwd, env=env, timeout=timeout)


def run_on_ranks(ranks: int, script, *args, env=None, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS SCRIPT ARGS...` through benchmarks/forked_ranks.py (the ranks
    forked from the process that imported the trainer), one thread per rank."""
    launch = [ROOT / "benchmarks" / "forked_ranks.py", "--standalone", f"--nproc-per-node={ranks}"]
    return run_python(*launch, script, *args, cwd=cwd, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


def run_cli_on_ranks(ranks: int, *args: str, cwd=None, env=None, timeout=900) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS -m mtnlg_lightning.train.cli ARGS`: `mtnlg ARGS` on RANKS ranks
    that torchrun's agent started (Lightning, seeing them, starts no others), forked as `run_on_ranks`'s are."""
    return run_on_ranks(ranks, "-m", "mtnlg_lightning.train.cli", *args, cwd=cwd, env=env, timeout=timeout)
