"""Outputs on object storage that appear only when complete, as they do on disk (:mod:`mtnlg_lightning.outputs`).

An object store has no rename and no folder to swap, so a tool whose output is a URL writes its files in a local
scratch folder (the work files of a resumable run live there too) and, once all of them are complete, commits
them: every file is uploaded under a hidden staging prefix (``.mtnlg-staging-<token>/`` beside the outputs, which
every reader of this project passes over, as it passes over dot folders on disk); the previous marker file (the
report, the dataset's ``.idx``) is removed; the staged objects are copied into place server-side, the marker last;
the staging prefix is removed. A run that fails or is killed before the copies leaves the previous result as it
was (its staging objects, hidden, are removed by the next commit there); during the copies, the missing marker
says the result is not complete, as a missing ``report.json`` says on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning import outputs
from mtnlg_lightning.corpora.storage import CorpusError
from mtnlg_lightning.errors import MTNLGError

STAGING = ".mtnlg-staging"
# the schemes fsspec reads over plain HTTP: nothing can be written there
READ_ONLY_SCHEMES = ("http", "https")


def scratch_dir(url: str) -> str:
    """The local folder of a run whose output is ``url``: the same folder on a re-run of the same command (so a
    killed run resumes), a different one for another output."""
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    name = storage.basename(url) or "output"
    return str(storage.cache_root() / "scratch" / f"{name}-{key}")


def check_writable(url: str) -> None:
    """Fail before any work, with one line, on an output URL that cannot be written: a read-only scheme, a bucket
    that does not exist, credentials refused."""
    scheme = storage.url_scheme(url)
    if scheme in READ_ONLY_SCHEMES:
        raise CorpusError(f"{url}: {scheme}:// URLs are read-only; write the output to a path or an object store")
    fs, path = storage.filesystem(url)
    bucket = path.split("/", 1)[0]
    with storage.remote_errors(url):
        if not fs.exists(bucket):
            raise CorpusError(f"{url}: no such bucket (the bucket does not exist)")


def check_output(target: str, inputs: Sequence[str | None], replaces_dir: bool = False) -> None:
    """:func:`mtnlg_lightning.outputs.check_output` for paths and URLs alike: an output is never an input, never
    inside an input folder or prefix, and one that replaces a whole folder never contains an input (nor, for a
    URL, is a whole bucket). One line each."""
    given = [str(i) for i in inputs if i is not None and str(i) != ""]
    if not storage.is_url(target):
        outputs.check_output(target, [i for i in given if not storage.is_url(i)], replaces_dir)
        return
    out = target.rstrip("/")
    for source in (i.rstrip("/") for i in given if storage.is_url(i)):
        if out == source:
            raise MTNLGError(f"the output {target} is the input {source}; name another output")
        if out.startswith(source + "/") and storage.isdir(source):
            raise MTNLGError(f"the output {target} lies inside the input {source}; name an output outside it")
        if replaces_dir and source.startswith(out + "/"):
            raise MTNLGError(f"the output {target} contains the input {source}; replacing it would delete that input")
    if replaces_dir and "/" not in out.split("://", 1)[1]:
        raise MTNLGError(f"refusing to replace {target}: it is a whole bucket; name a prefix inside it")


def _staging_base(urls: Sequence[str]) -> str:
    schemes = {storage.url_scheme(u) for u in urls}
    if len(schemes) != 1:
        raise CorpusError(f"the outputs {', '.join(urls)} are on different stores; name one store for all of them")
    scheme = schemes.pop()
    paths = [u.split("://", 1)[1] for u in urls]
    common = posixpath.commonpath([posixpath.dirname(p) for p in paths]) or paths[0].split("/", 1)[0]
    return f"{scheme}://{common}"


def commit(files: Sequence[tuple[str, str]], markers: int = 1) -> None:
    """Publish local files at their URLs: ``files`` is [(local path, URL)], the last ``markers`` of them marking
    the result complete (removed first, copied last)."""
    if not files:
        return
    base = _staging_base([u for _, u in files])
    clear_staging(base)
    staging = f"{base}/{STAGING}-{uuid.uuid4().hex}"
    staged = []
    for local, url in files:
        rel = url.split("://", 1)[1][len(base.split("://", 1)[1]) :].lstrip("/")
        staged.append(f"{staging}/{rel}")
        storage.upload(local, staged[-1])
    head = len(files) - markers
    for _, url in files[head:]:
        storage.remove(url)
    for (_, url), tmp in zip(files, staged, strict=True):
        storage.copy(tmp, url)
    storage.remove(staging, recursive=True)


def clear_staging(base: str) -> None:
    """Staging objects left under ``base`` by runs killed before their commit finished."""
    for url in storage.children(base):
        if storage.basename(url).startswith(STAGING + "-"):
            storage.remove(url, recursive=True)


@dataclass
class Destination:
    """Where a tool writes: ``target`` as the user named it (a folder or a URL prefix) and ``local``, the folder
    it writes in: the target itself on disk, a scratch folder for a URL, whose files :meth:`publish` commits."""

    target: str
    local: str
    remote: bool
    created: list[str] = field(default_factory=list)

    def url(self, name: str) -> str:
        return storage.join(self.target, name)

    def publish(self, names: Sequence[str] | None = None, markers: int = 1, replace: bool = False) -> None:
        """Commit the local files ``names`` (relative, '/'-separated; the markers last; default: every file of the
        folder outside hidden folders) to the target; with ``replace`` (``--overwrite``), the target's other
        visible objects are removed afterwards, as a replaced folder loses them. The scratch folder goes after the
        commit. On disk the files are already in place: nothing to do."""
        if not self.remote:
            return
        names = visible_files(self.local) if names is None else list(names)
        files = [(os.path.join(self.local, *n.split("/")), self.url(n)) for n in names]
        commit(files, markers)
        if replace:
            kept = {self.url(n) for n in names}
            for url in storage.list_files(self.target):
                rel = url[len(self.target) + 1 :]
                if url not in kept and not any(part.startswith(".") for part in rel.split("/")):
                    storage.remove(url)
        self.discard()

    def discard(self) -> None:
        """Remove the scratch folder of a URL output (after a commit, or after bad input: nothing to resume)."""
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)


def visible_files(folder: str) -> list[str]:
    """Every file below ``folder`` outside hidden folders and not hidden itself, relative and '/'-separated."""
    found = []
    for d, dirs, files in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        found += [os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/") for f in files if f[:1] != "."]
    return sorted(found)


def destination(target: str, fresh: bool = True) -> Destination:
    """The :class:`Destination` of an output folder or URL prefix. ``fresh``: a URL's scratch folder starts empty
    (tools that do not resume); otherwise it is kept from a killed run of the same command."""
    if not storage.is_url(target):
        return Destination(target, target, False)
    check_writable(target)
    local = scratch_dir(target)
    if fresh:
        shutil.rmtree(local, ignore_errors=True)
    os.makedirs(local, exist_ok=True)
    return Destination(target.rstrip("/"), local, True)


@contextlib.contextmanager
def output_files(target: str, suffixes: Sequence[str]) -> Iterator[str]:
    """The local prefix to write the files ``target + suffix`` at: ``target`` itself on disk; for a URL a scratch
    prefix whose files are committed there when the block ends without an error, the last suffix's file last (a
    dataset's ``.idx`` marks it complete). The scratch files go either way."""
    if not storage.is_url(target):
        yield target
        return
    check_writable(target)
    local_dir = scratch_dir(target)
    shutil.rmtree(local_dir, ignore_errors=True)
    os.makedirs(local_dir)
    try:
        local = os.path.join(local_dir, storage.basename(target))
        yield local
        commit([(local + s, target + s) for s in suffixes], markers=1 if len(suffixes) > 1 else 0)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def output_file(target: str):
    """:func:`output_files` of one file: the local path to write ``target`` at."""
    return output_files(target, ("",))
