"""Every restart accounted for: one line in the run's log and one JSON line in `restarts.jsonl` beside the
checkpoints, written by rank 0 of the restarted group once it has resumed:

    restart 2: resumed from step 6 (rank 0 on node1 hang (exit 124) in save at step 6); 0 steps redone, 41 s lost

    {"restart": 2, "time": "...", "cause": "...", "failures": [{"rank": 0, "host": "node1", "exit": 124,
     "what": "hang (exit 124)", "phase": "save", "step": 6}], "lost_hosts": [], "resumed_from": ".../step=6.ckpt",
     "resumed_step": 6, "furthest_step": 6, "steps_redone": 0, "downtime_s": 41.2, "time_lost_s": 41.2,
     "layout_before": {...}, "layout": {...}, "layout_change": null}

What the restarted group knows comes from the launcher (`MTNLG_RESTART_RECORD`: exit codes, hosts, lost nodes,
gathered from every node's launcher) and from the rank statuses of the attempt before (`rank_status.py`: phase,
step, last progress), which plain torchrun leaves too. Time lost is the time from the last progress before the
fault to the resume, plus the redone steps at the failed attempt's mean step time.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from mtnlg_lightning.outputs import atomic_write, write_json
from mtnlg_lightning.resilience.attempt import RESTART_CAUSE_ENV, restart_cause, restart_count
from mtnlg_lightning.resilience.rank_status import read_statuses, status_dir

RESTART_RECORD_ENV = "MTNLG_RESTART_RECORD"  # JSON, set by resilience/launch.py for the workers it restarts
RECORD_FILE = "restarts.jsonl"


def layout_of(trainer) -> dict:
    """The layout a run trains in: ranks, nodes, the parallel degrees and how the global batch is made."""
    world = int(trainer.world_size)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or trainer.num_devices or 1)
    layout = getattr(trainer.strategy, "layout", None)
    tp, pp = (layout.tensor_parallel, layout.pipeline_parallel) if layout is not None else (1, 1)
    dp = layout.data_parallel if layout is not None else world
    found = {"world": world, "nodes": max(1, world // per_node), "dp": dp, "tp": tp, "pp": pp}
    module = trainer.lightning_module
    schedule, micro = getattr(module, "batch_schedule", None), getattr(module, "micro_batch_size", None)
    if schedule is not None and micro:
        global_batch = schedule.batch_size_at_samples(int(getattr(module, "consumed_samples", 0)))
        found |= {"global_batch": global_batch, "micro_batches_per_replica": global_batch // (micro * dp)}
        # which world sizes the run can use (`elastic.usable_nodes`): every batch still ahead divides into
        # micro-batches over the replicas when these do (after the ramp, the global batch alone)
        sizes = {global_batch, schedule.global_batch_size}
        if global_batch != schedule.global_batch_size:
            sizes.add(schedule.rampup_increment)
        found |= {"replica_ranks": tp * pp, "micro_batch": micro, "batch_sizes": sorted(sizes)}
    return found


def describe_layout_change(
    before: dict | None, now: dict, lost_hosts: list[str], spare_hosts: list[str] = ()
) -> str | None:
    """What changed between two layouts and why, or None when the run resumes in the layout it had."""
    keys = ("world", "dp", "tp", "pp")
    if not before or all(before.get(k) == now.get(k) for k in keys):
        return None
    text = (
        f"now {now['nodes']} node(s), {now['world']} ranks = dp {now['dp']} x tp {now['tp']} x pp {now['pp']}, "
        f"was {before.get('nodes')} node(s), {before.get('world')} ranks = dp {before.get('dp')} x "
        f"tp {before.get('tp')} x pp {before.get('pp')}"
    )
    if now["world"] < before.get("world", 0):
        text += (
            f": {', '.join(lost_hosts) if lost_hosts else 'a node'} did not come back, and the run goes on with "
            f"the largest layout the remaining nodes hold"
        )
    else:
        text += ": nodes came back, and the run grows to the largest layout they hold"
    if spare_hosts:
        text += f"; {len(spare_hosts)} node(s) wait as spares ({', '.join(spare_hosts)})"
    if "global_batch" in now:
        text += (
            f"; the global batch stays {now['global_batch']}, {now['micro_batches_per_replica']} micro-batch(es) "
            f"per replica per step (was {before.get('micro_batches_per_replica')}): the optimisation is unchanged"
        )
    return text


def _cause_from_statuses(statuses: list[dict]) -> str | None:
    """Under plain torchrun, which reports no exit codes to the workers: the ranks the watchdog stopped, where."""
    hung = [s for s in statuses if s.get("hang")]
    if not hung:
        return None
    return "; ".join(f"rank {s['rank']} on {s['host']} hang in {s['phase']} at step {s['step']}" for s in hung)


def build_record(trainer, count: int, now: float | None = None) -> dict:
    """The record of restart `count`, from the launcher's report and the statuses the attempt before left."""
    now = time.time() if now is None else now
    launcher = json.loads(os.environ.get(RESTART_RECORD_ENV) or "{}")
    statuses = read_statuses(status_dir(), count - 1)
    steps = [s["step"] for s in statuses if isinstance(s.get("step"), int)]
    furthest = max([*steps, launcher.get("furthest_step", -1)], default=-1)
    last_progress = max([s.get("last_beat", 0.0) for s in statuses] + [launcher.get("last_progress", 0.0)])
    step_times = [s["mean_step_s"] for s in statuses if s.get("mean_step_s")] + [launcher.get("mean_step_s", 0.0)]
    mean_step = max(step_times)
    resumed_step = int(trainer.global_step)
    redone = max(0, furthest - resumed_step) if furthest >= 0 else None
    downtime = max(0.0, now - last_progress) if last_progress > 0 else None
    before = launcher.get("layout_before") or next((s["layout"] for s in statuses if s.get("layout")), None)
    layout = layout_of(trainer)
    lost = list(launcher.get("lost_hosts", []))
    cause = os.environ.get(RESTART_CAUSE_ENV) or _cause_from_statuses(statuses) or restart_cause()
    return {
        "restart": count,
        "time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "cause": cause,
        "failures": launcher.get("failures", []),
        "lost_hosts": lost,
        "resumed_from": str(trainer.ckpt_path) if trainer.ckpt_path else None,
        "resumed_step": resumed_step,
        "furthest_step": furthest if furthest >= 0 else None,
        "steps_redone": redone,
        "downtime_s": round(downtime, 1) if downtime is not None else None,
        "time_lost_s": round(downtime + (redone or 0) * mean_step, 1) if downtime is not None else None,
        "layout_before": before,
        "layout": layout,
        "spare_hosts": launcher.get("spare_hosts", []),
        "layout_change": describe_layout_change(before, layout, lost, launcher.get("spare_hosts", [])),
    }


def record_line(record: dict) -> str:
    """`restart k: resumed from step N (cause); R steps redone, T s lost` (the cause last in parentheses, where
    operators' greps read it; `started from scratch (no complete checkpoint)` when there was nothing to resume)."""
    if record["resumed_from"]:
        where = f"resumed from step {record['resumed_step']}"
    else:
        where = "started from scratch (no complete checkpoint)"
    costs = []
    if record["steps_redone"] is not None:
        costs.append(f"{record['steps_redone']} step{'s' if record['steps_redone'] != 1 else ''} redone")
    if record["time_lost_s"] is not None:
        costs.append(f"{record['time_lost_s']:.0f} s lost")
    return f"restart {record['restart']}: {where} ({record['cause']})" + (f"; {', '.join(costs)}" if costs else "")


def append_record(directory: Path, record: dict) -> Path:
    """Add `record` to `directory/restarts.jsonl`, atomically (the file is rewritten whole, then swapped in)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECORD_FILE
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    if before and not before.endswith("\n"):
        before += "\n"
    with atomic_write(path, "w", fsync=True) as handle:
        handle.write(before + json.dumps(record, sort_keys=True) + "\n")
    return path


def read_records(directory: Path) -> list[dict]:
    """The records of `directory/restarts.jsonl`, oldest first (none when it does not exist)."""
    path = Path(directory) / RECORD_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def report_restart(trainer, checkpoint_dirs: list[Path]) -> dict | None:
    """Rank 0 of a restarted group: the line in the log (and the layout change, once), the line in restarts.jsonl
    beside the checkpoint it resumed (else in the run's first checkpoint folder), and a copy for the launcher's
    summary."""
    count = restart_count()
    if count == 0 or not trainer.is_global_zero:
        return None
    record = build_record(trainer, count)
    print(record_line(record), flush=True)
    if record["layout_change"]:
        print(f"restart {count}: layout changed: {record['layout_change']}", flush=True)
    directory = Path(record["resumed_from"]).parent if record["resumed_from"] else None
    directory = directory or (checkpoint_dirs[0] if checkpoint_dirs else None)
    if directory is not None:
        append_record(directory, record)
    local = status_dir()
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
        write_json(local / f"attempt{count}_restart.json", record)
    return record
