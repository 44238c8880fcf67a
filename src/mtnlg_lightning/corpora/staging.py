"""Any input as plain JSON lines, one line per record, for the tools that work on byte ranges of plain files.

The curation tools address documents by (file, byte offset) and split files into byte ranges; a compressed file
has no byte ranges to split, and an object in a store answers each byte range with a request. A non-plain input,
and any input named by a URL, is therefore streamed once into the run's work directory as plain JSON lines (one
task per file, in parallel) and everything after runs on that copy. Line ``n`` of the copy is record ``n`` of the
input (blank lines of JSON lines are kept), so line numbers in messages and reports are the input's own, and
the kept lines map back to the input's rows when the output is written in its format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.formats import Format, detect, open_read
from mtnlg_lightning.corpora.jsonl import atomic_write
from mtnlg_lightning.corpora.readers import iter_raw
from mtnlg_lightning.corpora.sources import expand_inputs


@dataclass(frozen=True)
class CorpusInput:
    """One input file of a curation run."""

    path: str  # absolute, or a URL
    label: str  # as the user can find it, for messages
    name: str  # output-relative name
    fmt: Format


def resolve_inputs(specs: list[str]) -> list[CorpusInput]:
    """Files, folders and globs to input files with their formats (a missing package is reported here, before
    any work starts)."""
    return [
        CorpusInput(f.path if storage.is_url(f.path) else os.path.abspath(f.path), f.path, f.name, detect(f.path))
        for f in expand_inputs(specs)
    ]


def needs_copy(inp: CorpusInput) -> bool:
    """Whether the run works on a plain copy of ``inp`` rather than the file itself."""
    return not inp.fmt.plain_jsonl or storage.is_url(inp.path)


def _stage_task(_shared, job: tuple) -> int:
    return stage_plain(*job)


def plain_copies(inputs: list[CorpusInput], work_dir: str, engine, columns: list[str] | None = None) -> list[str]:
    """The plain JSON lines to work on for every input: the input itself when it is a local plain JSON-lines file,
    else its copy under ``work_dir`` (made by ``engine``, one task per file; a copy already there is kept)."""
    paths, jobs = [], []
    for i, inp in enumerate(inputs):
        if not needs_copy(inp):
            paths.append(inp.path)
            continue
        dest = os.path.join(work_dir, f"f{i:05d}.jsonl")
        paths.append(dest)
        if not os.path.exists(dest):
            jobs.append((inp.path, inp.fmt, dest, columns))
    jobs.sort(key=lambda j: -storage.getsize(j[0]))  # the largest first: the workers finish together
    if jobs:  # none: no engine call at all (on Ray even an empty stage costs a task)
        for _ in engine.map(_stage_task, jobs):
            pass
    return paths


def stage_plain(path: str, fmt: Format, dest: str, columns: list[str] | None = None) -> int:
    """Write ``path`` as plain JSON lines to ``dest`` (atomically; kept when already there). Parquet rows and
    JSON array items become one JSON object per line (``columns`` only, when given). Returns its size."""
    if os.path.exists(dest):
        return os.path.getsize(dest)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with atomic_write(dest, "wb") as out:
        if fmt.kind == "jsonl":
            with open_read(path, fmt.compression) as f:
                last = b"\n"
                while block := f.read(1 << 22):
                    out.write(block)
                    last = block[-1:]
                if last != b"\n":
                    out.write(b"\n")
        else:
            dumps = json.JSONEncoder(ensure_ascii=False, default=str).encode
            for _, item in iter_raw(path, fmt, columns):
                out.write(dumps(item).encode("utf-8", "surrogatepass") + b"\n")
    return os.path.getsize(dest)
