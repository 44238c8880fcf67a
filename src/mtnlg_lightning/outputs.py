"""How every tool writes: into a staging path, swapped in only when the whole result is complete; never over one
of its inputs, and `--overwrite` never over a folder that holds (or is) an input, the current or home directory
or the file-system root. Files and folders follow the user's umask.

As rsync and git: the previous result stays as it was until the new one is complete, so a failed run (bad input,
a crash, Ctrl-C) loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from mtnlg_lightning.errors import MTNLGError


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (no window for another thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", fsync: bool = False) -> Iterator[IO[Any]]:
    """Write `path` atomically: a temp file in the same directory, `os.replace`d over it when the block ends
    without an error (with `fsync`, flushed to disk first). On any error the temp file is removed and `path` is
    left as it was. The file gets the permissions an ordinary `open` would (mkstemp's are 0600)."""
    with atomic_path(path) as tmp, open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        yield f
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def write_json(path: str | os.PathLike, payload: Any, fsync: bool = False, **dump_options) -> None:
    """`payload` as JSON (indent 1 unless `dump_options` say otherwise) and a final newline, atomically."""
    with atomic_write(path, "w", fsync=fsync) as f:
        json.dump(payload, f, **({"indent": 1} | dump_options))
        f.write("\n")


def write_json_lines(path: str | os.PathLike, records: Iterable[Any]) -> Path:
    """`records` as JSON lines at `path`, written atomically."""
    with atomic_write(path, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = False) -> Iterator[str]:
    """`atomic_write` for writers that need a file name (safetensors, tokenizers, torch.save): yields a temp name
    next to `path`, moved over `path` when the block ends without an error (with `fsync`, flushed first)."""
    staged = StagedFile(path, fsync)
    try:
        yield staged.temp
        staged.commit()
    except BaseException:
        staged.discard()
        raise


class StagedFile:
    """The temp file of `atomic_path`, for a file written over several calls (e.g. a dataset's shards):
    `commit()` moves it over `path`, `discard()` removes it."""

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        self.path, self.fsync = os.fspath(path), fsync
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, self.temp = tempfile.mkstemp(prefix="." + os.path.basename(self.path) + ".", suffix=".tmp", dir=directory)
        os.close(fd)
        os.chmod(self.temp, file_mode())

    def commit(self) -> None:
        if self.fsync:
            fd = os.open(self.temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(self.temp, self.path)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.temp)


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """A fresh hidden folder next to `target` to write the whole result in; when the block ends without an error
    it replaces `target` (the previous one is moved aside and removed only after the swap); on an error it is
    removed and `target` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".staging", dir=target.parent))
    try:
        os.chmod(staging, dir_mode())  # mkdtemp creates 0700
        yield staging
        replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing target is moved aside first and removed only after the swap."""
    old = None
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def kept_until_done(target: str | os.PathLike) -> Iterator[Path]:
    """For a long run whose files must live at their final path while it runs (configs name them): the previous
    `target` is moved aside, a fresh `target` is yielded; when the block ends without an error the previous one is
    removed, on an error (or Ctrl-C) the partial result is removed and the previous one put back."""
    target = Path(target)
    aside = None
    if target.exists() and any(target.iterdir()):
        aside = target.with_name(f".{target.name}.previous-{os.getpid()}")
        os.replace(target, aside)
    target.mkdir(parents=True, exist_ok=True)
    try:
        yield target
    except BaseException:
        if aside is not None:
            shutil.rmtree(target, ignore_errors=True)
            os.replace(aside, target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the guard
def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def check_output(target: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], replaces_dir: bool) -> None:
    """Refuse, with one line, an output that would destroy what it must not: an output that is an input, lies
    inside an input folder or contains an input; and, where the output replaces a whole folder (`replaces_dir`,
    e.g. `--overwrite`), one that is or contains the current directory, the home directory or the root."""
    out = Path(target).expanduser().resolve()
    for given in inputs:
        if given is None or str(given) == "":
            continue
        source = Path(given).expanduser().resolve()
        if out == source:
            raise MTNLGError(f"the output {target} is the input {given}; name another output")
        if _inside(out, source) and source.is_dir():
            raise MTNLGError(f"the output {target} lies inside the input {given}; name an output outside it")
        if replaces_dir and _inside(source, out):
            raise MTNLGError(f"the output {target} contains the input {given}; replacing it would delete that input")
    if replaces_dir:
        protected = {"the file-system root": Path(out.anchor), "the current directory": Path.cwd().resolve()}
        with contextlib.suppress(RuntimeError, KeyError):
            protected["the home directory"] = Path.home().resolve()
        for what, folder in protected.items():
            if _inside(folder, out):
                raise MTNLGError(f"refusing to replace {target}: it is or contains {what} ({folder})")


def check_input_file(path: str | os.PathLike) -> None:
    """A file a tool reads: it exists, is a file (not a folder) and is not empty -- one line each."""
    path = Path(path)
    if not path.exists():
        raise MTNLGError(f"{path} does not exist")
    if not path.is_file():
        raise MTNLGError(f"{path} is a directory, expected a file")
    if path.stat().st_size == 0:
        raise MTNLGError(f"{path} is empty")
