"""Runs `python ARGS` for the tests without paying the interpreter's start-up each time.

The commands the suite runs as a user would (`mtnlg fit`, `mtnlg-generate`, `tools/plan.py`, rank launches through
`benchmarks/forked_ranks.py`) import torch, Lightning (and through it torchmetrics, transformers and scipy), DeepSpeed
and the trainer: about 8 s of CPU each on the 2-core CI machine, several minutes of the suite. This process imports
them once, then forks a child per command (`conftest.run_python`), as Android's zygote and multiprocessing's fork
server do. The child becomes what `python ARGS` would have been:

- its own session (a timeout kills the whole tree, Lightning's rank processes included), stdin from /dev/null,
  stdout and stderr to the files the test reads;
- the working directory, the environment and `sys.argv` of the command;
- `sys.path` as a fresh interpreter's: the script's folder (or, for `-m`, the working directory) first, then the
  interpreter's own entries, without this harness's;
- the script, module or `-c` code run as `__main__` (runpy), and the interpreter's own exit: atexit handlers,
  non-daemon threads joined, an uncaught exception printed with exit status 1, `SystemExit`'s code as the status.

Protocol on stdin/stdout, one JSON line per request: {"argv", "cwd", "env", "stdout", "stderr"}; the answer is the
line "pid N" when the child runs, then "exit STATUS" (negative: killed by that signal) when it has ended.
Commands whose environment changes what the interpreter does at start-up (PYTHON* variables) are not sent here.
"""

from __future__ import annotations

import builtins
import json
import os
import runpy
import sys
import types

PRELOADED = ("torch", "lightning.pytorch", "deepspeed", "mtnlg_lightning.train.cli")


def fresh_interpreter_path() -> list[str]:
    """sys.path as `python -c` starts with it, less the leading '' (the caller puts the command's own first)."""
    return [entry for entry in json.loads(os.environ.pop("ZYGOTE_FRESH_SYS_PATH")) if entry]


def serve(protocol_in, protocol_out) -> dict:
    """Forks a child per request and reports its end; returns, in the child only, the request it is to run."""
    for line in protocol_in:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            protocol_in.close()
            protocol_out.close()
            return request
        protocol_out.write(f"pid {pid}\n")
        protocol_out.flush()
        _, status = os.waitpid(pid, 0)
        protocol_out.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
        protocol_out.flush()
    raise SystemExit(0)  # the suite closed the pipe


def become(request: dict, base_path: list[str]) -> None:
    """This (child) process takes the command's place, then runs it as the interpreter would."""
    os.setsid()
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        with open(path, "wb") as out:
            os.dup2(out.fileno(), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    target, *arguments = request["argv"]
    if target == "-c":
        code, *arguments = arguments
        sys.argv = ["-c", *arguments]
        sys.path[:] = ["", *base_path]
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        exec(compile(code, "<string>", "exec"), main.__dict__)
    elif target == "-m":
        module, *arguments = arguments
        sys.argv = [module, *arguments]  # runpy puts the module's file in argv[0]
        sys.path[:] = [os.getcwd(), *base_path]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *arguments]
        sys.path[:] = [os.path.dirname(os.path.abspath(target)), *base_path]
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    base_path = fresh_interpreter_path()
    # the protocol moves off fds 0 and 1, which each child points at its command's stdin and stdout; what the imports
    # print goes to this process's log (its stderr)
    protocol_in = os.fdopen(os.dup(0), "r")
    protocol_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOADED:
        try:
            __import__(name)
        except ImportError:  # an extra that is not installed: its commands import it themselves
            pass
    become(serve(protocol_in, protocol_out), base_path)
