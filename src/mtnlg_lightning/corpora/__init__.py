"""Reading and writing the formats pretraining corpora ship in, for every data tool.

* :mod:`.formats`: what a file holds, from its first bytes (never its name): JSON lines or a JSON array, plain,
  gzip or zstd; or parquet. Opening a stream for reading or writing in each compression.
* :mod:`.sources`: command-line inputs (files, folders searched recursively, globs, any mix) to an ordered list of
  files, each with the name its output takes.
* :mod:`.readers`: the records of one file, streamed (a parquet record batch, one line at a time), each with its
  place in the file for messages and reports.
* :mod:`.records`: what makes a record bad, and the ``--on-bad-record error|skip`` policy with counts per reason.
* :mod:`.writers`: outputs in a chosen compression or as parquet, written atomically.

A new format (a WARC reader for Common Crawl) is one more ``kind`` in :mod:`.formats` and one more branch of
:func:`.readers.iter_raw`; every tool then reads it.
"""

from mtnlg_lightning.corpora.formats import CorpusError, Format, detect
from mtnlg_lightning.corpora.records import BAD_REASONS, BadRecordPolicy, Record
from mtnlg_lightning.corpora.sources import InputFile, expand_inputs

__all__ = [
    "BAD_REASONS",
    "BadRecordPolicy",
    "CorpusError",
    "Format",
    "InputFile",
    "Record",
    "detect",
    "expand_inputs",
]
