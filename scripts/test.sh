#!/usr/bin/env bash
# One command from a fresh clone: install what is missing (with test extras), then run the test suite.
# The suite runs on MTNLG_TEST_WORKERS pytest-xdist workers (default 2, one per core of the CI machine; 0: in this
# process), one test module per worker at a time, so a module's shared launches run once. Extra arguments go to
# pytest, e.g. -m "not slow" for the fast lane.
#
# --under-load: the load check instead. A CPU hog on every core (`while True: pass`, one per `nproc`, ended when this
# script ends), and under it the 10 slowest drills, three rounds in a row (MTNLG_UNDER_LOAD_ROUNDS), stopping at the
# first failure; each round's result and seconds are printed. The drills wait for what their runs report, not for
# fixed wall-clock budgets (testing/run_watch.py), so a loaded machine makes them slower, not red.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export WANDB_MODE=offline
# Each worker's share of the cores for its torch threads (and its subprocesses'): the workers' default of every core
# each oversubscribed a 2-core machine (an in-process fit's OpenMP threads waiting on a core the other worker's
# launch held), e.g. the bias study's two 250-step fits took 194 s in the suite against 26 s alone. A caller's
# OMP_NUM_THREADS is kept. The ranks of a launch run one thread each anyway (testing/local_ranks.py).
workers=${MTNLG_TEST_WORKERS:-2}
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc itself answers OMP_NUM_THREADS when it is set
if [ "$workers" -gt 0 ]; then
  threads=$((cores / workers))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
fi
PYTEST=("${PYTHON:-python3}" -m pytest -q -ra --durations=25 -n "$workers" --dist loadfile)

if [ "${1:-}" != "--under-load" ]; then
  exec "${PYTEST[@]}" "$@"
fi
shift

# The 10 slowest multi-process drills of a full run, from its --durations (.ci/run from a clean clone on the 2-core
# machine, 2026-12-06, commit 1886b2e; seconds of that run, "setup" where a module's shared launch runs before its
# first test). Re-pick them from a newer run's --durations when the suite changes.
DRILLS=(
  # 190 s call
  "tests/test_resilience.py::test_plain_torchrun_heals_a_kill_after_a_save_stops_during_a_save_and_a_step_and_a_kill_in_an_evaluation"
  # 120 s setup (the module's 2-rank launch of every layout)
  "tests/test_parallel_equivalence.py::test_layout_trains_like_one_process[tp2_ckpt-2]"
  # 99 s setup (the module's 2-rank launch)
  "tests/test_layouts_of_families_and_long_sequences.py::test_the_layout_trains_like_one_process[llama_tp2_ckpt-2]"
  # 85 s setup (the module's launch of every expert-parallel run)
  "tests/test_expert_parallel.py::test_expert_parallel_trains_like_one_process[ep2_ckpt]"
  # 81 s call
  "tests/test_resilience.py::test_a_run_grows_back_when_nodes_join_keeps_a_node_its_layout_cannot_use_as_a_spare_and_the_spare_takes_over"
  # 71 s setup (the module's 2-rank launch of every Muon layout)
  "tests/test_muon.py::test_muon_trains_like_one_process_in_every_layout[gpt_tp2_sp]"
  # 55 s setup (the module's 2-rank launch of every GRPO layout)
  "tests/test_grpo.py::test_grpo_samples_and_trains_alike_in_every_layout[dp2]"
  # 51 s call
  "tests/test_gpu_check.py::test_gpu_check_dry_run_runs_every_stage_and_writes_one_json"
  # 45 s call
  "tests/test_resilience.py::test_a_run_that_loses_a_node_for_good_goes_on_with_fewer_replicas_and_the_losses_of_the_uninterrupted_run"
  # 34 s call
  "tests/test_expert_parallel.py::test_a_trained_moe_checkpoint_generates_and_scores_in_expert_parallel_layouts_as_in_one_process"
)

hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$cores"); do
  "${PYTHON:-python3}" -c 'while True: pass' &
  hogs+=("$!")
done
echo "under load: ${#hogs[@]} CPU hog(s) running (pids ${hogs[*]}), ${#DRILLS[@]} drills"

rounds=${MTNLG_UNDER_LOAD_ROUNDS:-3}
for round in $(seq "$rounds"); do
  started=$(date +%s)
  status=0
  "${PYTEST[@]}" "${DRILLS[@]}" "$@" || status=$?
  seconds=$(($(date +%s) - started))
  if [ "$status" -ne 0 ]; then
    echo "under load: round $round of $rounds FAILED (exit $status) after $seconds s" >&2
    exit "$status"
  fi
  echo "under load: round $round of $rounds passed in $seconds s"
done
echo "under load: $rounds round(s) in a row passed"
