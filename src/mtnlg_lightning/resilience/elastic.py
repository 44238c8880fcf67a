"""What the launchers of all nodes agree on at each start of the group (`launch.py` exchanges their reports over the
rendezvous store): the number and id of the start, why it restarted, and which nodes train.

A run trains on the largest number of nodes its layout can use: the same TP x PP, and a data-parallel size that
divides every batch size of the schedule in micro-batches (so the global batch, and with it the optimisation, stays
the same; more gradient accumulation makes up for fewer replicas). The nodes beyond it wait as spares: they start
no ranks, take part in every rendezvous and take over when a node is lost. MT-NLG 530B: TP 8 x PP 35 = 35 nodes
of 8 GPUs per replica; during the batch ramp (32, 64, ..., 1920) DP must divide 32, so 559 nodes train as 280
(DP 8); after it DP must divide 1920, so they train as 525 (DP 15, 128 micro-batches per step).

The layout's rule (ranks per replica, micro-batch, batch sizes) comes from the ranks' status files (`rank_status`):
until a rank of the run has started once, every node that joined trains.
"""

from __future__ import annotations

RULE_KEYS = ("replica_ranks", "micro_batch", "batch_sizes")


def layout_rule(layout: dict | None) -> dict | None:
    """The part of a rank's layout (`restart_record.layout_of`) that says which world sizes the run can use."""
    if not layout or not all(layout.get(key) for key in RULE_KEYS):
        return None
    return {key: layout[key] for key in RULE_KEYS}


def usable_nodes(nodes: int, ranks_per_node: int, rule: dict | None) -> int:
    """The most of `nodes` the run can train on (all of them while the rule is unknown, or when none fits: the
    ranks then report the layout error themselves)."""
    if rule is None:
        return nodes
    for count in range(nodes, 0, -1):
        world = count * ranks_per_node
        if world % rule["replica_ranks"]:
            continue
        unit = rule["micro_batch"] * (world // rule["replica_ranks"])
        if all(size % unit == 0 for size in rule["batch_sizes"]):
            return count
    return nodes


def agree(agents: list[dict], ranks_per_node: int) -> dict:
    """This start, from every launcher's report (in group-rank order): {attempt, attempt_id, training (nodes that
    start ranks), cause, record (for `restart_record.py`), spares (hosts)}. Every launcher computes the same."""
    attempt = max(agent["started"] for agent in agents)
    nodes = {agent["node"]: agent["host"] for agent in agents}
    before: dict[str, str] = {}
    for agent in agents:
        before |= agent["nodes_before"]
    lost = sorted(host for node, host in before.items() if node not in nodes)
    joined = sorted(host for node, host in nodes.items() if before and node not in before)
    rule = next((agent["rule"] for agent in agents if agent.get("rule")), None)
    training = usable_nodes(len(agents), ranks_per_node, rule)
    spares = [agent["host"] for agent in agents[training:]]
    failures = [failure for agent in agents for failure in (agent["fault"] or {}).get("failures", [])]
    progress = [agent["progress"] for agent in agents if agent.get("progress")]
    causes = [failure["text"] for failure in failures]
    causes += [f"node {host} lost: it did not come back to the rendezvous" for host in lost]
    causes += [f"node {host} joined" for host in joined]
    record = {
        "failures": [{key: value for key, value in failure.items() if key != "text"} for failure in failures],
        "lost_hosts": lost,
        "joined_hosts": joined,
        "spare_hosts": spares,
        "furthest_step": max((done["furthest_step"] for done in progress), default=-1),
        "last_progress": max((done["last_progress"] for done in progress), default=0.0),
        "mean_step_s": max((done["mean_step_s"] for done in progress), default=0.0),
        "layout_before": next((done["layout_before"] for done in progress if done["layout_before"]), None),
    }
    return {
        "attempt": attempt,
        "attempt_id": f"{attempt}_{agents[0]['id']}",
        "training": training,
        "cause": "; ".join(causes) or "the group was restarted",
        "record": record,
        "spares": spares,
        "nodes": nodes,
    }
