"""The flags every data tool shares for its inputs and outputs, with the same words in every ``--help``."""

from __future__ import annotations

from mtnlg_lightning.corpora.formats import COMPRESSIONS
from mtnlg_lightning.corpora.records import POLICIES

FORMATS_HELP = "JSON lines plain, gzip or zstd (told from the bytes, not the name), JSON arrays of records, parquet"
URLS_HELP = (
    "paths or URLs (s3://bucket/corpus/, gs://..., https://... to read; the [cloud] extra; credentials from the "
    "AWS_* variables or the fsspec config)"
)
INPUTS_HELP = (
    "files, folders (searched recursively for *.jsonl, *.json, *.parquet, *.gz, *.zst) or globs, in any mix, "
    + URLS_HELP
    + "; "
    + FORMATS_HELP
)
OUTPUT_URL_HELP = "a URL (s3://bucket/out) is written in a local scratch folder and committed there when complete"


def add_bad_record_arg(p) -> None:
    p.add_argument(
        "--on-bad-record",
        choices=list(POLICIES),
        default="error",
        metavar="POLICY",
        help="a record that is not a JSON object, not UTF-8, lacks the text field or has a non-string or empty "
        "text: 'error' stops with one line naming its file and line; 'skip' leaves it out and counts it by reason "
        "in the summary and the report",
    )


def add_output_compression_arg(p) -> None:
    p.add_argument(
        "--output-compression",
        choices=list(COMPRESSIONS),
        default=None,
        help="compression of the JSON-lines outputs (default: each output as its input; a parquet input gives "
        "parquet); a changed compression changes the output name's .gz/.zst suffix",
    )
