"""Fine-tuning records to conversations: the forms users bring, read by the corpus readers (JSON lines or a JSON
array, plain, gzip or zstd; parquet; folders, globs and `s3://` prefixes).

A record is one of:
- `messages` (OpenAI) or `conversations` (ShareGPT): a list of turns, each `role` and `content` (or ShareGPT's
  `from` and `value`, with `human`/`gpt` for user/assistant);
- alpaca: `instruction`, an optional `input` (appended to the instruction after a blank line) and `output`, with an
  optional `system`;
- `prompt` and `completion`: strings (one user turn and one assistant turn) or lists of turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mtnlg_lightning.corpora.readers import iter_objects
from mtnlg_lightning.errors import MTNLGError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
KNOWN_FORMS = "messages (or conversations), instruction + output (alpaca), or prompt + completion"


@dataclass
class Conversation:
    messages: list[dict]
    where: str  # FILE:LINE (or row / item), for messages about this record


def _turn(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise MTNLGError(f"{where}: a turn is {type(turn).__name__}, expected an object with role and content")
    if "role" in turn:
        return dict(turn)
    if "from" in turn and "value" in turn:  # ShareGPT
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower(), str(turn["from"]))
        return {"role": role, "content": turn["value"]}
    raise MTNLGError(f"{where}: a turn has fields {', '.join(sorted(map(str, turn)))}; expected role and content")


def _turns(value, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise MTNLGError(f"{where}: {field} must be a non-empty list of turns")
    return [_turn(turn, where) for turn in value]


def _text(record: dict, field: str, where: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise MTNLGError(f"{where}: {field} is {type(value).__name__}, expected a string")
    return value


def to_messages(record: dict, where: str) -> list[dict]:
    """The conversation a record holds; one MTNLGError line naming the record and the fields seen otherwise."""
    for field in ("messages", "conversations"):
        if field in record:
            return _turns(record[field], where, field)
    if "instruction" in record and "output" in record:
        user = _text(record, "instruction", where)
        if record.get("input"):
            user = f"{user}\n\n{_text(record, 'input', where)}"
        system = [{"role": "system", "content": _text(record, "system", where)}] if record.get("system") else []
        return [
            *system,
            {"role": "user", "content": user},
            {"role": "assistant", "content": _text(record, "output", where)},
        ]
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, list):
            return _turns(prompt, where, "prompt") + _turns(completion, where, "completion")
        return [
            {"role": "user", "content": _text(record, "prompt", where)},
            {"role": "assistant", "content": _text(record, "completion", where)},
        ]
    seen = ", ".join(sorted(map(str, record))) or "none"
    raise MTNLGError(f"{where}: a record in no known form (fields: {seen}); expected {KNOWN_FORMS}")


def read_conversations(specs: str | list[str]) -> Iterator[Conversation]:
    """Every record of the files `specs` names (files, folders, globs, URLs), in a fixed order."""
    for where, record in iter_objects([specs] if isinstance(specs, str) else list(specs)):
        yield Conversation(to_messages(record, where), where)
