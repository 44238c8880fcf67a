"""The drills' waiter (testing/run_watch.py): it waits while the run progresses, fails at once when the job ends
first, fails on a silence longer than its idle window or past its ceiling, and then says what the run was doing."""

import subprocess
import sys
import time

import pytest

from testing.run_watch import RunWatch, run


def job(tmp_path, code: str, name: str = "job"):
    log = tmp_path / f"{name}.log"
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=handle, stderr=subprocess.STDOUT)
    return process, log


TALKER = "import time\nfor i in range(400):\n    print('step', i, flush=True)\n    time.sleep(0.1)\n"


def test_a_wait_outlasts_its_floor_while_the_run_progresses_and_returns_the_condition_s_value(tmp_path):
    process, log = job(tmp_path, TALKER)
    try:
        watch = RunWatch({"talker": (process, log)}, floor_s=0.5, ceiling_s=30)
        started = time.monotonic()
        found = watch.until(lambda: "step 20" in log.read_text() and 20, "step 20")
        assert found == 20 and time.monotonic() - started > 1.5  # three floors, and still waiting: it progressed
        assert watch.events >= 2 and watch.idle_window() == max(0.5, 5 * watch.longest_silence)
    finally:
        process.kill()
        process.wait()


def test_a_silent_run_fails_after_its_idle_window_saying_what_it_was_doing(tmp_path):
    process, log = job(tmp_path, "import time\nprint('loaded the model', flush=True)\ntime.sleep(60)\n")
    try:
        watch = RunWatch({"quiet": (process, log)}, floor_s=1.0, ceiling_s=30, describe=lambda: "rank 0: at step 3")
        started = time.monotonic()
        with pytest.raises(AssertionError) as failed:
            watch.until(lambda: False, "step 4")
        assert 1.0 < time.monotonic() - started < 10
        message = str(failed.value)
        assert message.startswith("gave up waiting for step 4 after") and "no progress for" in message
        assert f"job quiet (pid {process.pid}): running" in message and "rank 0: at step 3" in message
        assert "| loaded the model" in message  # the end of its log
    finally:
        process.kill()
        process.wait()


def test_a_job_that_ends_first_fails_the_wait_at_once_and_finish_returns_its_code(tmp_path):
    process, log = job(tmp_path, "print('bad config'); raise SystemExit(2)")
    watch = RunWatch({"launcher": (process, log)}, floor_s=60, ceiling_s=120)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"job launcher ended \(rc 2\) first") as failed:
        watch.until(lambda: False, "step 1")
    assert time.monotonic() - started < 10 and "| bad config" in str(failed.value)
    assert watch.finish("launcher") == 2
    watch.until(lambda: True, "anything")  # ended and awaited: no longer a failure


def test_a_run_that_progresses_without_getting_there_fails_at_the_ceiling(tmp_path):
    process, log = job(tmp_path, TALKER)
    try:
        watch = RunWatch({"talker": (process, log)}, floor_s=60, ceiling_s=1.5)
        with pytest.raises(AssertionError, match="the ceiling of 2 s passed, the run still progressing"):
            watch.finish("talker")
    finally:
        process.kill()
        process.wait()


def test_run_is_subprocess_run_with_its_output_under_a_watch(tmp_path):
    code = "import sys; print('out'); print('err', file=sys.stderr); raise SystemExit(3)"
    result = run([sys.executable, "-c", code], tmp_path, "tiny")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert (tmp_path / "tiny.err").read_text() == "err\n"
