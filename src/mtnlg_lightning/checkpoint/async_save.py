"""Background checkpoint saves (`async_save: true` on the strategy): the step's state is copied to host memory on
the training thread, then a writer thread writes the files, gathers every rank's file list and publishes the
manifest + atomic rename, while training goes on.

- At most one save is in flight: the next save (or a load, or the end of fit) first waits for the previous one.
- The writer talks over its own gloo process group, so its collectives never interleave with the training's.
- A crash during a background write leaves only the hidden staging folder: the previous complete checkpoint stays
  the newest (`commit.py`). Removals of older checkpoints (keep-last-k) wait until the newer one is published.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.heartbeat import heartbeat


class BackgroundSaver:
    def __init__(self, group):
        self.group = group  # a gloo group of every rank, used by the writer thread only
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after_publish: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` on the writer thread (after the previous save, if one is still in flight, has finished)."""
        self.wait()

        def run() -> None:
            try:
                write()
                with self._lock:
                    pending, self._after_publish = self._after_publish, []
                for action in pending:
                    action()
            except BaseException as error:  # noqa: BLE001 - raised on the training thread at the next wait
                self._error = error

        self._thread = threading.Thread(target=run, name="mtnlg-checkpoint-writer", daemon=True)
        self._thread.start()

    def after_publish(self, action: Callable[[], None]) -> None:
        """Run `action` once the save in flight is published (now, if none is)."""
        with self._lock:
            if self.in_flight:
                self._after_publish.append(action)
                return
        action()

    def wait(self) -> None:
        """Block until the save in flight is published; re-raise its error here, on the training thread."""
        if self._thread is not None:
            if self._thread.is_alive():  # as long as the write: the hang watchdog learns it apart from the saves
                heartbeat("save", "background write")
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, MTNLGError | OSError):  # the user's or the machine's: one line, as a foreground save
                raise error
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error

    def abandon(self) -> None:
        """After an exception in training: do not wait (the peers may be gone); the staging folder stays unpublished
        if the writer cannot finish, and the previous complete checkpoint stays the newest."""
        self._thread = None
        self._after_publish = []
