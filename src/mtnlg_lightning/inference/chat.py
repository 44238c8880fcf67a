"""`mtnlg-generate --chat`: a prompt as a user turn (after an optional system turn), rendered with the model's chat
template and its generation prompt, as `apply_chat_template(messages, add_generation_prompt=True)` gives it; the
answer ends where the assistant's turn ends.

The template is the one the source carries (a checkpoint's chat_template.jinja, a Hugging Face directory's) or the
one `--chat-template` names (`data.chat_template.resolve_template`: a name, a .jinja file or the text). The turn
ends at the template's end-of-turn token, the eos token, a Hugging Face directory's generation_config.json eos ids
or the end-of-text token; an end marker that this tokenizer encodes as several tokens (ChatML on a tokenizer without
its special tokens) ends it by its text, which the answer does not show.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.checkpoint.format import is_checkpoint
from mtnlg_lightning.checkpoint.model_state import ModelState
from mtnlg_lightning.data.chat_template import ChatTokenizer, EndOfTurn, has_chat_template
from mtnlg_lightning.data.tokenizer import EOD_TOKENS
from mtnlg_lightning.errors import MTNLGError

OPTION = "--chat-template"


@dataclass
class Chat:
    tokenizer: ChatTokenizer
    end: EndOfTurn

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        turns = [{"role": "system", "content": system}] if system is not None else []
        try:
            return self.tokenizer.prompt_ids([*turns, {"role": "user", "content": prompt}])
        except MTNLGError:
            raise
        except Exception as error:  # jinja2's errors, a template's raise_exception
            message = " ".join(str(error).split()) or type(error).__name__
            raise MTNLGError(f"the chat template fails on the prompt {prompt[:40]!r}: {message}") from None

    def stop_text(self):
        """The `generate_batch` stop test for the markers that are several tokens (None when every end is one
        token): whether the text of the last few tokens holds one (the marker ends in the newest token, and every
        token is at least a byte)."""
        if not self.end.texts:
            return None
        window = max(len(marker.encode("utf-8")) for marker in self.end.texts) + 2

        def ends(tokens: list[int]) -> bool:
            return self.end.ends(self.tokenizer.decode(tokens[-window:]))

        return ends

    def answer(self, tokens: list[int]) -> str:
        return self.end.cut(self.tokenizer.decode(tokens))


def _tokenizer_json(path: Path) -> Path:
    return path / "tokenizer.json" if path.is_dir() else path


def _generation_eos_ids(directory: Path | None) -> list[int]:
    """The eos ids of a Hugging Face directory's generation_config.json (none of a checkpoint folder, which carries
    no such file)."""
    if directory is None or is_checkpoint(directory) or not (directory / "generation_config.json").is_file():
        return []
    try:
        eos = json.loads((directory / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as error:
        raise MTNLGError(f"{directory / 'generation_config.json'} is unreadable: {error}") from None
    eos = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in eos if isinstance(i, int)]


def chat_for(source: ModelState, name: str, tokenizer: str | None = None, template: str | None = None) -> Chat:
    """The chat of the model source `name`: its tokenizer (or `tokenizer`, a tokenizer.json or directory, whose own
    template comes with it) and its template (or `template`)."""
    path = Path(tokenizer) if tokenizer else source.tokenizer
    if path is None:
        raise MTNLGError("the checkpoint names no tokenizer: pass --tokenizer PATH (tokenizer.json or directory)")
    directory = path if has_chat_template(path) else source.chat
    if template is None and not has_chat_template(directory):
        raise MTNLGError(
            f"{name} carries no chat template: pass {OPTION} NAME|FILE|TEXT (a name: chatml, llama3; a .jinja "
            f"file; or the template text)"
        )
    chat = ChatTokenizer(directory, template, _tokenizer_json(path), option=OPTION)
    eod = [chat.tokenizer.token_to_id(t) for t in EOD_TOKENS if chat.tokenizer.token_to_id(t) is not None][:1]
    return Chat(chat, chat.end_of_turn([*_generation_eos_ids(directory), *eod]))
