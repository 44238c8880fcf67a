"""What the tests (tests/) and the benchmarks (benchmarks/) share, outside the package: the forked-rank launcher
(`forked_ranks.py`, `local_ranks.py`), one short training run (`lightning_run.py`), the layout-equivalence harness
and its rank script (`parallel_harness.py`, `dist_parallel_runs.py`, `gathered_weights.py`), the measurements
(`comm_counter.py`, `state_bytes.py`, `activation_memory.py`), and the checkpoints and faults made on purpose
(`checkpoint_fuzzing.py`, `synthetic_checkpoint.py`, `slow_checkpoint_writes.py`, `fault_probe.py`), the drills'
waiter (`run_watch.py`: waits while a launched run progresses) and the suite's time budget per test file
(`suite_budget.py`, a pytest plugin).

Both sides import it as `testing.NAME` with the repository root on `sys.path` (tests/conftest.py puts it there; a
script adds it itself); it imports neither side (tests/test_imports.py checks).
"""
