"""The budget per test file (testing/suite_budget.py), on a small suite of its own run by pytest in a subprocess on
two pytest-xdist workers, as scripts/test.sh runs the real one: a file over a tiny budget fails the whole run with
one line naming it; a run of chosen tests or files is not judged."""

import os
import subprocess
import sys

from conftest import ROOT

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})


def pytest_configure(config):
    from testing.suite_budget import register

    register(config)
"""


def suite(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.6)\n\ndef test_b():\n    time.sleep(0.6)\n"
    )
    (tmp_path / "test_quick.py").write_text("def test_c():\n    pass\n")


def pytest_run(tmp_path, *args, budget="1.0"):
    env = {**os.environ, "MTNLG_FILE_BUDGET_S": budget}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_file_over_its_budget_fails_the_whole_run_with_one_line_and_the_table_shows_the_slowest(tmp_path):
    suite(tmp_path)
    run = pytest_run(tmp_path)
    out = run.stdout
    assert run.returncode == 1 and "3 passed" in out, out[-3000:]  # every test passed: the budget failed the run
    (line,) = [x for x in out.splitlines() if x.startswith("suite budget:")]
    seconds = float(line.split(" took ")[1].split(" s,")[0])
    assert line == f"suite budget: test_slow.py took {seconds:.1f} s, over the budget of 1 s per file " \
        "(MTNLG_FILE_BUDGET_S, testing/suite_budget.py)" and seconds >= 1.2  # fmt: skip
    table = out.split("slowest 10 test files (setup + call + teardown); budget 1 s per file")[1].splitlines()
    assert table[1].endswith("s  test_slow.py") and table[2].endswith("s  test_quick.py"), out[-2000:]


def test_within_the_budget_or_with_chosen_tests_the_run_passes(tmp_path):
    suite(tmp_path)
    for run in (pytest_run(tmp_path, budget="30"), pytest_run(tmp_path, "-k", "a or b"), pytest_run(tmp_path, ".")):
        assert run.returncode == 0 and "suite budget:" not in run.stdout, run.stdout[-3000:]
    assert "budget not checked" in pytest_run(tmp_path, "test_slow.py").stdout
