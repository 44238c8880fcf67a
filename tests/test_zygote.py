"""The suite's commands forked from tests/zygote.py behave as `python ARGS` in a fresh interpreter would."""

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, fresh_shell_environment, run_python

PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                      "env": os.environ.get("PROBE_VALUE"), "rank": os.environ.get("RANK"),
                      "harness_on_path": any(p.endswith("tests") for p in sys.path[1:])}))
    print("to stderr", file=sys.stderr)
    if sys.argv[1:] == ["raise"]:
        raise ValueError("probe failed")
    sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
    """
)


def fresh_python(*args, cwd, env):
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, env=fresh_shell_environment(env), capture_output=True, text=True
    )


@pytest.mark.parametrize("arguments", [[], ["3"], ["raise"]], ids=["exit-0", "exit-3", "exception"])
def test_a_forked_command_is_what_a_fresh_interpreter_would_run(tmp_path, monkeypatch, arguments):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("RANK", "5")  # a rendezvous variable of this process is not handed on
    forked = run_python(script, *arguments, cwd=tmp_path, env={"PROBE_VALUE": "x"})
    fresh = fresh_python(script, *arguments, cwd=tmp_path, env={"PROBE_VALUE": "x"})
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert json.loads(forked.stdout.splitlines()[0])["rank"] is None
    assert forked.stderr.splitlines()[0] == "to stderr"
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]  # the exception's line, where one ended it


def test_a_module_run_with_dash_m_finds_the_working_directory_first(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    forked = run_python("-m", "probe_module", "4", cwd=tmp_path)
    fresh = fresh_python("-m", "probe_module", "4", cwd=tmp_path, env=None)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (4, fresh.stdout)
    assert json.loads(forked.stdout.splitlines()[0])["path0"] == str(tmp_path)


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    script = tmp_path / "sleeper.py"
    sleep = "import time; time.sleep(60)"
    script.write_text(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {sleep!r}])\n{sleep}\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(script, cwd=tmp_path, timeout=3)
    assert run_python("-c", "print('next')", cwd=ROOT).stdout == "next\n"  # the zygote serves the next command
