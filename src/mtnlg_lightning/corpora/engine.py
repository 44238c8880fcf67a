"""Engines that execute a stage's tasks: in this process, in a local process pool, or as Ray tasks.

A task is ``fn(shared, item)`` with ``fn`` a module-level function, ``shared`` read-only data every task of the
stage needs (settings, a task n-gram index) and ``item`` one partition (a shard, a band, a range of pairs).
Tasks read and write files on storage every worker sees (the run's work directory; with an output URL on Ray, each
worker's copy of it, kept in step through the store by :mod:`.mirror`) and are idempotent, so a retried or resumed
task rewrites the same bytes. ``map`` yields results in task order, which is what makes the
outputs independent of the engine and of the number of workers.
"""

from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mtnlg_lightning.corpora.jsonl import InputError
from mtnlg_lightning.corpora.mapcache import clear_maps
from mtnlg_lightning.corpora.mirror import MirrorDriver, WorkMirror, relocate, scan
from mtnlg_lightning.extras import install_hint

Task = Callable[[Any, Any], Any]

# Set only inside local pool worker processes, by the pool initializer: the stage's shared data, shipped to each
# worker once instead of with every task. The driver never reads or writes it.
_pool_shared: Any = None


def _set_pool_shared(shared: Any) -> None:
    # A worker must die on the pool's terminate() (SIGTERM). Forked workers inherit the driver's Python-level
    # handlers (Ray installs one at ray.init and it outlives ray.shutdown), and such a handler left an idle worker
    # running and terminate() waiting for it forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    global _pool_shared
    _pool_shared = shared


def _call_with_pool_shared(job: tuple[Task, Any]) -> Any:
    fn, item = job
    return fn(_pool_shared, item)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class LocalEngine:
    """Tasks in this process (``workers=1``, or a stage of one task) or in a pool of forked worker processes.

    The pool lives as long as the stages hand it the same shared data (one pool per run for both tools), so the
    workers are started once rather than per stage.
    """

    name = "local"

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)
        self._pool = None
        self._pool_shared = None

    @property
    def cpus(self) -> int:
        return self.workers

    def map(self, fn: Task, items: Iterable, shared: Any = None) -> Iterator:
        items = list(items)
        if min(self.workers, len(items)) <= 1:
            for item in items:
                yield fn(shared, item)
            return
        if self._pool is None or self._pool_shared is not shared:
            self.close()
            # objects the driver has made so far go to a permanent generation, so that the garbage collector of
            # the forked workers does not write to them (every such write copies a page shared with the driver)
            gc.freeze()
            self._pool = multiprocessing.Pool(self.workers, initializer=_set_pool_shared, initargs=(shared,))
            self._pool_shared = shared
        try:
            yield from self._pool.imap(_call_with_pool_shared, [(fn, item) for item in items], chunksize=1)
        except BaseException:  # error, interrupt or a consumer that left: stop the workers now
            self._pool.terminate()
            self._pool.join()
            self._pool = self._pool_shared = None
            raise

    def close(self) -> None:
        clear_maps()  # the maps this process opened (workers=1: every task ran here)
        if self._pool is not None:
            self._pool.close()  # workers exit on their own (terminate() would SIGTERM them)
            self._pool.join()
            self._pool = self._pool_shared = None


# Set only inside Ray worker processes: the stage's shared data, fetched and deserialised once per worker (a task
# n-gram index takes longer to unpickle than a small task takes to run). Holds the newest stage's only.
_ray_shared: dict[str, Any] = {}


# Set only inside Ray worker processes of a mirrored run: the manifest this process last brought its copy to.
_ray_synced: dict[str, str] = {}


def _ray_call(fn: Task, shared_box: list, items: list, mirror_box: list | None = None):
    """Run ``fn`` over a chunk of a stage's items in one Ray task (a Ray task costs milliseconds to schedule).
    With a mirror (``mirror_box``), on this process's copy of the work folder: returns (results, files written)."""
    import ray  # optional extra [ray]: imported on use

    ref = shared_box[0]  # boxed, so that Ray hands over the reference instead of a fresh copy for every task
    key = ref.hex()
    if key not in _ray_shared:
        _ray_shared.clear()
        _ray_shared[key] = ray.get(ref)
    try:
        if mirror_box is None:
            return [fn(_ray_shared[key], item) for item in items]
        mirror, manifest = ray.get(mirror_box[0])
        root = mirror.worker_root()
        if _ray_synced.get(root) != mirror_box[0].hex():
            mirror.sync(root, manifest)
            _ray_synced.clear()
            _ray_synced[root] = mirror_box[0].hex()
        before = scan(root)
        shared = relocate(_ray_shared[key], mirror.local_root, root)
        results = [fn(shared, relocate(item, mirror.local_root, root)) for item in items]
        return results, mirror.upload_new(root, before)
    finally:
        clear_maps()  # a Ray worker outlives the run: keep no map of a work directory that will be removed


class RayEngine:
    """Tasks as Ray tasks on a cluster (``address``, else ``RAY_ADDRESS``, else a local Ray started for the run).

    A task whose worker dies (killed, out of memory, node lost) is retried by Ray (``max_retries``); tasks are
    idempotent, so a retry writes the same files. An exception raised by a task (bad input) is not retried and
    is re-raised here as itself, so the CLIs print the same one-line error as with the local engine.
    """

    name = "ray"
    TASKS_PER_CPU = 4

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        max_retries: int = 3,
        mirror: WorkMirror | None = None,
    ):
        try:
            import ray  # optional extra [ray]: imported on use
        except ImportError:
            raise InputError(f"--engine ray needs Ray: {install_hint('ray')}") from None
        self.ray = ray
        self.started_here = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            # a local Ray started for this run: quiet (the CLI's stderr is for one-line errors)
            os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
            kwargs: dict[str, Any] = {
                "log_to_driver": False,
                "logging_level": logging.ERROR,
                "configure_logging": True,
            }
            if address is None:
                kwargs.update(num_cpus=num_cpus, include_dashboard=False)
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as err:
                reason = " ".join(str(err).split())
                raise InputError(f"cannot connect to the Ray cluster at {address}: {reason}") from None
            self.started_here = True
        self._remote = ray.remote(max_retries=max_retries)(_ray_call)
        self._put: tuple[Any, Any] | None = None  # (shared object, its object ref): stages sharing it put it once
        self.mirror = MirrorDriver(mirror) if mirror is not None else None

    @property
    def cpus(self) -> int:
        return int(self.ray.cluster_resources().get("CPU", 1))

    def map(self, fn: Task, items: Iterable, shared: Any = None) -> Iterator:
        ray = self.ray
        if self._put is None or self._put[0] is not shared:
            self._put = (shared, ray.put(shared))
        shared_ref = self._put[1]
        items = list(items)
        # items in chunks, ~4 Ray tasks per CPU: which items share a task changes nothing in the files written.
        # Chunk sizes differ by at most one item, so that the CPUs finish together: fixed-size chunks left one
        # CPU with half again as many items as the other (20 shards on 2 CPUs: chunks of 3,3,3,3,3,3,2).
        chunks = max(1, min(len(items), self.TASKS_PER_CPU * max(1, self.cpus)))
        bounds = [len(items) * c // chunks for c in range(chunks + 1)]
        mirror_box = None
        if self.mirror is not None and items:  # the workers' copies brought to the driver's folder first
            mirror_box = [ray.put((self.mirror.mirror, self.mirror.publish()))]
        futures = [self._remote.remote(fn, [shared_ref], items[a:b], mirror_box) for a, b in itertools.pairwise(bounds)]
        done = 0
        try:
            for f in futures:
                try:
                    results = ray.get(f)
                except ray.exceptions.RayTaskError as err:
                    cause = getattr(err, "cause", None)
                    raise (cause if isinstance(cause, BaseException) else err) from None
                if mirror_box is not None:
                    results, written = results
                    self.mirror.receive(written)
                done += 1
                yield from results
        finally:
            if done < len(futures):  # error, interrupt or a consumer that left: settle the rest before returning
                self._settle(futures[done:])

    def _settle(self, futures: list) -> None:
        """Cancel tasks not started yet and wait for the running ones, so that no task writes into a work
        directory after the caller has cleaned it up."""
        ray = self.ray
        _, pending = ray.wait(futures, num_returns=len(futures), timeout=0)
        for f in pending:
            ray.cancel(f, force=False)
        ray.wait(pending, num_returns=len(pending), timeout=600)

    def close(self) -> None:
        self._put = None
        if self.started_here:
            self.ray.shutdown()
            self.started_here = False


def make_engine(
    engine: str, workers: int, ray_address: str | None = None, mirror: WorkMirror | None = None
) -> LocalEngine | RayEngine:
    """The engine of a run; ``mirror``: the Ray workers work on copies of the work folder kept in step through the
    store (a run whose output is a URL; the local engine works in the folder itself)."""
    if engine == "local":
        return LocalEngine(workers)
    if engine == "ray":
        return RayEngine(ray_address, mirror=mirror)
    raise InputError(f"unknown engine {engine!r}; choose local or ray")
