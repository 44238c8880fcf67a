"""Every private name of torch elastic's agent that the launcher relies on, reached through this one module.

torchrun offers no public hook to decide what happens when a worker fails, to agree on each start across nodes,
or to build another agent: `launch.py`'s `ResilientAgent` does it by overriding `LocalElasticAgent`'s private
steps. `ElasticAgent` below is the only class that overrides or calls them: it hands each step to a public-named
hook that `ResilientAgent` overrides (`super().hook(...)` is torch's own step), and lends the agent's private state
under public names. `tests/test_framework_compat.py` lists every name (with who needs it), checks them against the
installed torch and fails when one is reached elsewhere; the torch floor in `pyproject.toml` is the first release
with all of them (`_shutdown`'s `timeout` came in torch 2.12). Should torch move one, this module is the place to
change (where torch builds its agent elsewhere, the launcher says so and plain torchrun remains).
"""

from __future__ import annotations

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


def install_agent(agent_class) -> bool:
    """Make torchrun's `launch_agent` build `agent_class` (it builds its agent from this one module global); False
    where this torch builds its agent elsewhere."""
    if not hasattr(launcher_api, "LocalElasticAgent"):
        return False
    launcher_api.LocalElasticAgent = agent_class
    return True


class ElasticAgent(LocalElasticAgent):
    """torchrun's local agent with its private steps handed to public hooks, and its private state lent."""

    # ------------------------------------------------------------------ torch's steps -> the hooks
    def _assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec):
        return self.assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _start_workers(self, worker_group):
        return self.start_workers(worker_group)

    def _stop_workers(self, worker_group, *args, **kwargs):
        return self.stop_workers(worker_group, *args, **kwargs)

    def _monitor_workers(self, worker_group):
        return self.monitor_workers(worker_group)

    # ------------------------------------------------------------------ the hooks: torch's own steps
    def assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec):
        """The workers of this node with their global ranks (each node's agent meets the others in `store`)."""
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def start_workers(self, worker_group):
        """Start the local workers; their pids by local rank."""
        return super()._start_workers(worker_group)

    def stop_workers(self, worker_group, *args, **kwargs):
        """Stop the local workers before a restart (SIGTERM, SIGKILL after 30 s)."""
        return super()._stop_workers(worker_group, *args, **kwargs)

    def monitor_workers(self, worker_group):
        """The workers' state (a `RunResult`), polled every few seconds while they run."""
        return super()._monitor_workers(worker_group)

    # ------------------------------------------------------------------ the agent's state
    def shutdown(self, death_sig, timeout: int) -> None:
        """Send the workers `death_sig` and kill those still running after `timeout` seconds."""
        self._shutdown(death_sig, timeout)

    @property
    def remaining_restarts(self) -> int:
        """How many restarts of the group are left (0: the next failure ends the run)."""
        return self._remaining_restarts

    @remaining_restarts.setter
    def remaining_restarts(self, value: int) -> None:
        self._remaining_restarts = value

    def forget_workers(self) -> None:
        """This node runs no workers this start (a spare): no process context to watch or stop."""
        self._pcontext = None

    def worker_processes(self) -> dict:
        """Local rank -> the worker's process (`subprocess.Popen`); empty before the workers start."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        return {rank: handler.proc for rank, handler in handlers.items()}

    def worker_pids(self) -> dict:
        """Local rank -> the worker's pid; empty when no workers run here."""
        return self._pcontext.pids() if self._pcontext is not None else {}
