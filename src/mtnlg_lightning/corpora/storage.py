"""Paths and URLs, opened one way: every data tool and the training data read local files and object-store URLs
(``s3://``, ``gs://``, ``az://``, ``https://`` read-only, ...) through this module.

A URL goes through fsspec, imported only when a URL is given (the ``[cloud]`` extra), so the core install reads
local paths with nothing more. Credentials and endpoints come from where the client libraries look for them
(``AWS_*`` variables, ``~/.aws``, ``AWS_ENDPOINT_URL``, the fsspec config); none is ever taken on a command line,
and no message here prints one. Every failure a user can fix (no such bucket or key, credentials refused, a
scheme with no installed file system) is one :class:`CorpusError` line naming the URL.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mtnlg_lightning.errors import InputError, MTNLGError, one_line
from mtnlg_lightning.extras import install_hint
from mtnlg_lightning.outputs import atomic_path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# a read streams through a buffer of this many bytes: one ranged GET per block, memory bounded whatever the file
READ_BLOCK = 8 << 20
# the packages that give fsspec its object stores (fsspec names them in its ImportError)
_PACKAGE_OF_SCHEME = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


class CorpusError(InputError, MTNLGError):
    """Bad corpus input (a missing file, a bad record, a missing optional package): one line, exit status 2.

    Both the curation tools' :class:`InputError` and the data tools' :class:`MTNLGError`, so every CLI prints
    it the way it prints its own errors."""


def cache_root() -> Path:
    """Where the project keeps what it may rebuild (the demo corpus, remote datasets' blocks, scratch folders of
    runs whose output is a URL): ``$MTNLG_CACHE``, else ``~/.cache/mtnlg_lightning``."""
    return Path(os.environ.get("MTNLG_CACHE", Path.home() / ".cache" / "mtnlg_lightning"))


def url_scheme(path: str | os.PathLike) -> str | None:
    """The scheme of a URL (``s3``, ``https``), None for a local path (``file://`` URLs are local paths)."""
    m = _URL.match(os.fspath(path))
    if not m or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(path: str | os.PathLike | None) -> bool:
    return path is not None and url_scheme(path) is not None


def local_path(path: str | os.PathLike) -> str:
    """A local path as the OS names it (a ``file://`` URL without its scheme)."""
    path = os.fspath(path)
    return path[len("file://") :] if path.lower().startswith("file://") else path


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with '/' for a URL, with the OS separator for a path."""
    if is_url(base):
        return posixpath.join(base.rstrip("/"), *(p.replace(os.sep, "/") for p in parts))
    return os.path.join(base, *parts)


def parent(path: str) -> str:
    if is_url(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(path))


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


# ------------------------------------------------------------------------------------------------ file systems
def filesystem(url: str):
    """``(fs, path)``: the fsspec file system of ``url`` and the path it names there. One line for a missing
    fsspec, a scheme fsspec does not know, or a known one whose package is not installed."""
    scheme = url_scheme(url)
    try:
        import fsspec  # optional extra [cloud]: imported on use
    except ImportError:
        raise CorpusError(f"{url}: reading and writing URLs needs fsspec: {install_hint('cloud')}") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        package = _PACKAGE_OF_SCHEME.get(scheme or "", "")
        hint = install_hint("cloud") if package == "s3fs" else f"pip install {package}" if package else one_line(err)
        raise CorpusError(f"{url}: no installed file system for {scheme}:// URLs ({hint})") from None
    except ValueError as err:
        if "protocol not known" in str(err).lower():
            raise CorpusError(f"{url}: no file system knows {scheme}:// URLs (fsspec has none for it)") from None
        raise CorpusError(f"{url}: {one_line(err)}") from None


def describe_error(url: str, err: BaseException) -> str:
    """One line for a failed request on ``url``: what went wrong and what to check, never a credential."""
    name = type(err).__name__
    text = one_line(err)
    if isinstance(err, FileNotFoundError):
        if "bucket" in text.lower():
            return f"{url}: no such bucket (the bucket does not exist)"
        return f"{url}: no such file (it does not exist)"
    if isinstance(err, PermissionError) or name in ("AccessDenied", "ClientAuthenticationError"):
        return (
            f"{url}: access denied ({text}): the credentials were refused or lack the permission; they come from "
            "the AWS_* variables, ~/.aws or the fsspec config"
        )
    if name in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"):
        return f"{url}: no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError"):
        return f"{url}: cannot reach the storage endpoint ({text})"
    return f"{url}: {text}"


@contextlib.contextmanager
def remote_errors(url: str) -> Iterator[None]:
    """Requests on ``url`` inside the block fail with one :class:`CorpusError` line."""
    try:
        yield
    except MTNLGError:
        raise
    except Exception as err:
        if _is_remote_failure(err):
            raise CorpusError(describe_error(url, err)) from None
        raise


def _is_remote_failure(err: BaseException) -> bool:
    module = type(err).__module__.split(".")[0]
    return isinstance(err, OSError) or module in ("botocore", "aiobotocore", "aiohttp", "google", "azure", "s3fs")


# ------------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class FileInfo:
    size: int
    version: str  # changes when the file does: mtime for a path, ETag or modification time for a URL
    is_dir: bool = False


def info(path: str) -> FileInfo:
    """Size and version of a file (a folder or prefix: ``is_dir``); one line when it does not exist."""
    if not is_url(path):
        path = local_path(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CorpusError(f"{path}: no such file (it does not exist)") from None
        return FileInfo(st.st_size, str(st.st_mtime_ns), os.path.isdir(path))
    fs, p = filesystem(path)
    with remote_errors(path):
        fs.invalidate_cache(p)
        found = fs.info(p)
    if found.get("type") == "directory":
        return FileInfo(0, "", True)
    version = found.get("ETag") or found.get("etag") or found.get("LastModified") or found.get("mtime") or ""
    return FileInfo(int(found.get("size") or 0), str(version).strip('"'), False)


def exists(path: str) -> bool:
    """Whether a file or folder is there; for a URL in a bucket that does not exist, one line saying so."""
    if not is_url(path):
        return os.path.exists(local_path(path))
    fs, p = filesystem(path)
    with remote_errors(path):
        fs.invalidate_cache(p)
        if fs.exists(p):
            return True
        if url_scheme(path) not in ("http", "https") and "/" in p.strip("/") and not fs.exists(p.split("/", 1)[0]):
            raise CorpusError(f"{path}: no such bucket (the bucket does not exist)")
    return False


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(local_path(path))
    fs, p = filesystem(path)
    with remote_errors(path):
        return fs.isdir(p)


def getsize(path: str) -> int:
    return info(path).size


def open_binary(path: str) -> IO[bytes]:
    """A buffered binary stream of ``path``: a local file, or a URL read in ranged requests of ``READ_BLOCK`` bytes
    as it is consumed (seekable; never the whole object at once)."""
    if not is_url(path):
        return open(local_path(path), "rb")  # noqa: SIM115 - the caller closes it
    fs, p = filesystem(path)
    with remote_errors(path):
        if fs.isdir(p):
            raise CorpusError(f"{path}: is a directory, expected a data file")
        raw = fs.open(p, "rb", block_size=READ_BLOCK, cache_type="readahead")
    # fsspec's own readline reads a whole block per line; io.BufferedReader splits lines in C
    return io.BufferedReader(_RemoteRaw(raw, path), READ_BLOCK)


class _RemoteRaw(io.RawIOBase):
    """An fsspec file as a raw stream; a request failing while it is read is one line naming the URL."""

    def __init__(self, file, url: str):
        self.file, self.url = file, url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        with remote_errors(self.url):
            data = self.file.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        if not self.closed:
            self.file.close()
        super().close()


def open_random_access(path: str):
    """A seekable binary file for readers that jump around (parquet footers and column chunks): the fsspec file
    itself for a URL (each read a ranged request), the local file otherwise."""
    if not is_url(path):
        return open(local_path(path), "rb")  # noqa: SIM115 - the caller (or its reader) closes it
    fs, p = filesystem(path)
    with remote_errors(path):
        return fs.open(p, "rb", block_size=1 << 20, cache_type="bytes")


def read_bytes(path: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``path`` (one ranged request for a URL)."""
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)
    fs, p = filesystem(path)
    with remote_errors(path):
        return fs.cat_file(p, start=start, end=end)


def download(url: str, dest: str) -> None:
    """``url`` to the local file ``dest``, atomically (a reader of ``dest`` never sees half of it)."""
    fs, p = filesystem(url)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with remote_errors(url), atomic_path(dest) as tmp:
        fs.get_file(p, tmp)


# ------------------------------------------------------------------------------------------------ listing
def list_files(url: str) -> list[str]:
    """Every object below the prefix ``url`` (its URLs, sorted), hidden ones too."""
    fs, p = filesystem(url)
    with remote_errors(url):
        fs.invalidate_cache(p)
        found = fs.find(p)
    return sorted(_as_url(url, f) for f in found)


def _as_url(like: str, fs_path: str) -> str:
    """An fsspec path (``bucket/key``) as a URL with the scheme the user wrote (``s3a://`` stays ``s3a://``)."""
    return fs_path if "://" in fs_path else f"{url_scheme(like)}://{fs_path}"


def children(url: str) -> list[str]:
    """The objects and prefixes directly below ``url`` (none when it does not exist), as URLs."""
    fs, p = filesystem(url)
    with remote_errors(url):
        fs.invalidate_cache(p)
        try:
            return sorted(_as_url(url, f) for f in fs.ls(p, detail=False))
        except FileNotFoundError:
            return []


def glob(pattern: str) -> list[str]:
    """The objects a glob matches (``**`` crosses folders), as URLs, sorted."""
    fs, p = filesystem(pattern)
    with remote_errors(pattern):
        fs.invalidate_cache()
        found = fs.glob(p, detail=True)
    return sorted(_as_url(pattern, k) for k, v in found.items() if v.get("type") != "directory")


# ------------------------------------------------------------------------------------------------ writing
def upload(local: str, url: str) -> None:
    """The local file ``local`` to ``url``. An object appears whole or not at all (a multipart upload becomes an
    object only when it completes)."""
    fs, p = filesystem(url)
    with remote_errors(url):
        fs.put_file(local, p)


def copy(src: str, dest: str) -> None:
    """Object ``src`` to ``dest`` on the same store, server-side (no bytes through this machine)."""
    fs, p = filesystem(src)
    _, q = filesystem(dest)
    with remote_errors(dest):
        fs.copy(p, q)


def remove(url: str, recursive: bool = False) -> None:
    """Delete an object (or, ``recursive``, everything below a prefix); nothing there is not an error."""
    fs, p = filesystem(url)
    with remote_errors(url):
        try:
            fs.rm(p, recursive=recursive)
        except FileNotFoundError:
            pass
    fs.invalidate_cache()
