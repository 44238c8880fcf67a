"""Fault drill: a run that must heal itself with no person, as at 4,480-GPU scale, shrunk to one machine.

    python benchmarks/fault_drill.py [--ranks 4 --strategy tp2_zero1 --steps 24 --every 4 --seed 0 --async-save]

The tiny model on tp2 x dp2 ZeRO-1 (4 ranks) runs under `python -m mtnlg_lightning.resilience.launch --max-restarts
4` while the drill injects, one after another: kill -9 of a random rank at a random moment (twice), kill -9 of a
random rank while a checkpoint is being written, and SIGSTOP of a random rank (caught by the hang watchdog). Then:
- the run must finish by itself (exit 0);
- every logged step's loss equals an uninterrupted run of the same layout within rel 1e-5;
- no fault makes the run redo more steps than the save interval (with `--async-save`: two intervals, since a fault
  during a background write falls back to the checkpoint before it);
- the hang is caught within the limit of the phase it struck plus a few seconds: the watchdog's own report names
  the phase and its limit (a step's is `--step-timeout`; a save's, a validation's and the data's are the limits the
  run learns, at least their 30 s floor).
It prints the time each recovery took (fault to the first step of the restarted group). The suite runs a reduced
drill: `tests/test_resilience.py` (2 ranks, one SIGSTOP).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from mtnlg_lightning.resilience.restart_record import read_records  # noqa: E402 - the launcher's restarts.jsonl

LOSS_RTOL = 1e-5
FAULTS = ("kill", "kill", "kill-during-save", "stop")
# the watchdog's report as it fires: `no progress in save for 31 s at step 24 (limit 30 s, ...`
WATCHDOG_FIRED = re.compile(r"no progress in (\S+) for [\d.]+ s at step (\d+) \(limit ([\d.]+) s")


def fit_command(args, save_dir: Path, ckpt: Path, probe: Path, restarts: int, hold_s: float) -> list[str]:
    command = [sys.executable, "-m", "mtnlg_lightning.resilience.launch", "--standalone"]
    command += ["--nproc-per-node", str(args.ranks), "--max-restarts", str(restarts), "--monitor-interval", "0.2"]
    # `mtnlg` with each checkpoint write held open `hold_s` seconds: a kill's window (the hold is test code)
    command += [str(ROOT / "testing" / "slow_checkpoint_writes.py"), str(hold_s)]
    command += ["fit", "--config", "configs/tiny.yaml"]
    command += ["--trainer.max_steps", str(args.steps), "--trainer.devices", str(args.ranks)]
    command += ["--trainer.strategy", f"configs/strategy/{args.strategy}.yaml"]
    if args.async_save:
        command += ["--trainer.strategy.async_save", "true"]
    command += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(save_dir)]
    command += ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=callbacks/checkpoint.yaml"]
    command += ["--trainer.callbacks.dirpath", str(ckpt), "--trainer.callbacks.every_n_train_steps", str(args.every)]
    command += ["--trainer.callbacks+=testing.fault_probe.Probe", "--trainer.callbacks.dir", str(probe)]
    return [*command, "--ckpt_path", "last"]


def start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    full_env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **env}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def losses_by_attempt(save_dir: Path) -> list[dict[int, float]]:
    """train_loss by step of each attempt (CSVLogger writes one `version_N` per start)."""
    attempts = []
    for path in sorted(save_dir.rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1])):
        rows = csv.DictReader(path.open())
        attempts.append({int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")})
    return attempts


def progress(probe: Path, ranks: int) -> tuple[dict[int, int], int]:
    """(rank -> pid of the current attempt, the lowest step every current rank has finished)."""
    pids, steps = {}, []
    for rank in range(ranks):
        try:
            pids[rank] = int((probe / f"rank{rank}.pid").read_text())
            lines = (probe / f"rank{rank}.steps").read_text().split("\n")
        except (FileNotFoundError, ValueError):
            return pids, -1
        mine = [int(s) for p, s in (x.split() for x in lines if x.strip()) if int(p) == pids[rank]]
        steps.append(max(mine, default=-1))
    return pids, min(steps)


def wait_for(condition, timeout: float, what: str, job: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if job.poll() is not None:
            raise SystemExit(f"fault drill: the run ended (exit {job.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"fault drill: timed out waiting for {what}")
        time.sleep(0.05)


def inject(args, job, probe: Path, ckpt: Path, log: Path, fault: str, rng: random.Random) -> dict:
    """Wait for a moment to strike, strike, and wait for the restarted group's first step."""
    pids, step = wait_for(
        lambda: (lambda p, s: (p, s) if s >= 0 else None)(*progress(probe, args.ranks)), 600, "the group to run", job
    )
    victim = rng.randrange(args.ranks)
    if fault == "kill-during-save":
        target = (step // args.every + 1) * args.every
        staging = ckpt / f".step={target}.ckpt.incomplete"  # a killed attempt may have left one: wait for a new one
        wait_for(lambda: progress(probe, args.ranks)[1] >= target, 600, f"step {target}", job)
        reached = time.time()
        wait_for(lambda: staging.exists() and staging.stat().st_mtime >= reached - 1, 600, f"save {target}", job)
        time.sleep(rng.uniform(0.05, 0.4))  # inside the held write (--hold-s)
    else:
        later = step + args.every + rng.randint(1, args.every)  # past a save of this attempt: something to resume
        wait_for(lambda: progress(probe, args.ranks)[1] >= later, 600, f"step {later}", job)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the next step
    pid = pids[victim]
    log_seen = log.stat().st_size
    struck = time.monotonic()
    os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    _, at = progress(probe, args.ranks)
    caught = phase = limit = None
    if fault == "stop":
        others = [p for r, p in pids.items() if r != victim]
        wait_for(lambda: any(not _alive(p) for p in others), 600, "the watchdog", job)
        caught = time.monotonic() - struck
        fired = wait_for(lambda: WATCHDOG_FIRED.search(_read_from(log, log_seen)), 30, "the watchdog's report", job)
        phase, limit = fired.group(1), float(fired.group(3))
    wait_for(lambda: _new_attempt_stepped(probe, args.ranks, pids), 900, "the restarted group's first step", job)
    recovery = time.monotonic() - struck
    record = {"fault": fault, "rank": victim, "at_step": at, "recovery_s": recovery}
    return record | {"caught_s": caught, "phase": phase, "limit_s": limit}


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _new_attempt_stepped(probe: Path, ranks: int, old: dict[int, int]) -> bool:
    pids, step = progress(probe, ranks)
    return step >= 0 and not set(pids.values()) & set(old.values())


def run(args, work: Path, faults: list[str], rng: random.Random) -> tuple[int, list[dict], Path]:
    save_dir, ckpt, probe, log = work / "logs", work / "ckpt", work / "probe", work / "log"
    work.mkdir(parents=True, exist_ok=True)
    env = {"MTNLG_STEP_TIMEOUT": str(args.step_timeout)}  # the other phases: the limits the run learns
    hold_s = args.hold_s if faults else 0.0
    job = start(fit_command(args, save_dir, ckpt, probe, restarts=len(faults), hold_s=hold_s), log, env)
    records = []
    try:
        for fault in faults:
            records.append(inject(args, job, probe, ckpt, log, fault, rng))
            r = records[-1]
            caught = ""
            if r["caught_s"] is not None:
                caught = f", caught after {r['caught_s']:.1f} s (in {r['phase']}, limit {r['limit_s']:g} s)"
            print(
                f"  {r['fault']:<17} rank {r['rank']} at step {r['at_step']}: recovered in {r['recovery_s']:.1f} s"
                f"{caught}",
                flush=True,
            )
        code = job.wait(timeout=1800)
    finally:
        if job.poll() is None:
            job.kill()
    return code, records, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="ranks on this machine (4: tp2 x dp2)")
    parser.add_argument("--strategy", default="tp2_zero1", help="a configs/strategy/*.yaml name")
    parser.add_argument("--steps", type=int, default=24, help="training steps of the run")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--step-timeout", type=float, default=10.0, help="MTNLG_STEP_TIMEOUT for the drill (s)")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help="comma-separated, in order: kill, kill-during-save, stop"
    )
    parser.add_argument("--hold-s", type=float, default=0.5, help="each checkpoint write is held open this long")
    parser.add_argument("--async-save", action="store_true", help="background checkpoint saves (async_save: true)")
    parser.add_argument("--seed", type=int, default=0, help="picks the ranks and the moments")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders here instead of a temporary folder")
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault(s) {unknown}: use kill, kill-during-save, stop")
    work = args.keep or Path(tempfile.mkdtemp(prefix="fault_drill_"))
    rng = random.Random(args.seed)
    print(
        f"fault drill: {args.ranks} ranks {args.strategy}{' async_save' if args.async_save else ''}, {args.steps} "
        f"steps, a checkpoint every {args.every}, faults {faults} (seed {args.seed}); folders in {work}",
        flush=True,
    )
    started = time.monotonic()
    code, _, _ = run(args, work / "reference", [], rng)
    if code != 0:
        raise SystemExit(f"fault drill: the uninterrupted run failed (exit {code}); see {work / 'reference' / 'log'}")
    print(f"uninterrupted run: {time.monotonic() - started:.0f} s", flush=True)
    started = time.monotonic()
    code, records, _ = run(args, work / "faults", faults, rng)
    elapsed = time.monotonic() - started
    reference = {s: v for attempt in losses_by_attempt(work / "reference" / "logs") for s, v in attempt.items()}
    attempts = losses_by_attempt(work / "faults" / "logs")
    log = (work / "faults" / "log").read_text()
    restarts = [(r["restart"], r["resumed_step"], r["cause"]) for r in read_records(work / "faults" / "ckpt")]
    problems = []
    if code != 0:
        problems.append(f"the run ended with exit {code}, not 0")
    if len(restarts) != len(faults):
        problems.append(f"{len(restarts)} restarts recorded in restarts.jsonl for {len(faults)} faults")
    merged = {s: v for attempt in attempts for s, v in attempt.items()}
    if sorted(merged) != sorted(reference):
        problems.append(f"logged steps {sorted(merged)} differ from the uninterrupted run's")
    worst = max((abs(merged[s] - reference[s]) / abs(reference[s]) for s in merged if s in reference), default=0.0)
    if worst > LOSS_RTOL:
        problems.append(f"a loss differs from the uninterrupted run by rel {worst:.2e} > {LOSS_RTOL:g}")
    # A fault during a background write falls back to the checkpoint before it: up to one more interval is redone.
    allowed = 2 * args.every if args.async_save else args.every
    for index, (_, resumed, _) in enumerate(restarts):
        if index < len(attempts) and attempts[index]:
            redone = max(attempts[index]) + 1 - resumed
            if redone > allowed:
                problems.append(f"restart {index + 1} redid {redone} steps, more than {allowed}")
    for record in records:
        if record["caught_s"] is None:
            continue
        if record["phase"] == "step" and record["limit_s"] != args.step_timeout:
            problems.append(f"the step's limit was {record['limit_s']:g} s, not --step-timeout {args.step_timeout:g} s")
        if record["caught_s"] > record["limit_s"] + 5:
            problems.append(
                f"the hang in {record['phase']} was caught after {record['caught_s']:.1f} s "
                f"(limit {record['limit_s']:g} s)"
            )
    if "connectFullMesh" in log:
        problems.append("a restart hit gloo connectFullMesh errors")
    print(
        f"faulted run: {elapsed:.0f} s, exit {code}; restarts: "
        + "; ".join(f"{k}: from step {n} ({c})" for k, n, c in restarts)
    )
    print(
        f"losses: {len(merged)} steps, max rel difference from the uninterrupted run {worst:.2e} (limit {LOSS_RTOL:g})"
    )
    if problems:
        print("FAILED: " + "; ".join(problems))
        raise SystemExit(1)
    print("PASSED: the run healed itself from every fault")


if __name__ == "__main__":
    main()
