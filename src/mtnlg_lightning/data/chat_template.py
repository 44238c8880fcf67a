"""Chat templates: a conversation to the token ids `transformers`' `apply_chat_template` gives, and which of them
are trained.

The template is the model directory's own (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`),
a named one (`NAMED_TEMPLATES`), a `.jinja` file or the template text itself. It is rendered as transformers renders
it (Jinja's immutable sandbox, `trim_blocks` and `lstrip_blocks`, its `tojson`, `raise_exception`, `strftime_now`
and `{% generation %}` tag, the directory's named special tokens as variables), and the text is encoded by the
directory's `tokenizer.json` through `tokenizers` (no special tokens added: the template writes them), so the ids
equal `apply_chat_template(messages, tokenize=True)` without transformers installed.

Which tokens are trained (the assistant's, the end-of-turn token included):
- a template with `{% generation %}` tags marks the assistant text itself; a token is trained when it overlaps a
  marked span (as transformers' `return_assistant_tokens_mask`);
- any other template: each assistant turn is the text that rendering `messages[:i + 1]` adds to rendering
  `messages[:i]` with the generation prompt (the turn's header is the prompt, so it is not trained), less the
  whitespace after its end-of-turn token (torchtune's render-and-diff, on characters so that tokenization in context
  cannot shift it: trl#1550).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mtnlg_lightning.errors import MTNLGError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
OPTION = "data.chat_template"  # the option that chooses a template, named in errors
# The named special tokens a template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")

# Templates by name, with `{% generation %}` around what the assistant says (its end-of-turn token included), so
# that their masks come from the tags.
NAMED_TEMPLATES = {
    # ChatML (Qwen 2/2.5/3 without reasoning, many others): no default system message.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Llama 3 / 3.1 / 3.2 instruct turns (without 3.1's dated system preamble).
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body, and while tracking records the body's character
    span in the output so far (transformers' AssistantTracker does the same)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self._tracking: ContextVar = ContextVar("generation_tracking", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller):
        text = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(block) for block in blocks)
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers renders them).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@contextmanager
def rendering_record(where: str):
    """A template's failure on one record (jinja2's errors, raise_exception's messages, a template's TypeError) as
    one error line naming the record."""
    try:
        yield
    except MTNLGError:
        raise
    except Exception as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise MTNLGError(f"{where}: the chat template fails on this record: {message}") from None


def compile_template(text: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise MTNLGError(f"the chat template does not parse: {error.message} (line {error.lineno})") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise MTNLGError(f"cannot read {path}: {error}") from None
    return data if isinstance(data, dict) else {}


def directory_template(directory: Path, config: dict, option: str = OPTION) -> str | None:
    """The directory's template as transformers picks it: `chat_template.jinja` first, else `chat_template` in
    tokenizer_config.json (a string, or a list of named templates of which `default` is used)."""
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        if "default" not in named:
            raise MTNLGError(
                f"{directory}/tokenizer_config.json has several chat templates ({', '.join(map(str, named))}) and "
                f"none named 'default'; choose one with {option}"
            )
        template = named["default"]
    return template if isinstance(template, str) else None


def resolve_template(directory: Path | None, config: dict, choice: str | None, option: str = OPTION) -> str:
    """The template text for `option` (`data.chat_template`, `--chat-template`): None (the directory's own), a name
    of NAMED_TEMPLATES, a path to a .jinja file, or the template text itself."""
    if choice is None:
        template = directory_template(directory, config, option) if directory is not None else None
        if template is None:
            where = f"{directory} has" if directory is not None else "the model carries"
            raise MTNLGError(
                f"{where} no chat template (no chat_template.jinja, none in tokenizer_config.json); set {option} to "
                f"one of {', '.join(NAMED_TEMPLATES)}, a .jinja file or the template text"
            )
        return template
    if choice in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[choice]
    if "{{" in choice or "{%" in choice:
        return choice
    if os.path.isfile(choice):
        return Path(choice).read_text(encoding="utf-8")
    raise MTNLGError(
        f"{option} {choice!r} is no template name ({', '.join(NAMED_TEMPLATES)}), no file and no Jinja text"
    )


def tokenizer_config(directory: Path) -> dict:
    """The directory's tokenizer_config.json ({} when it has none)."""
    file = Path(directory) / TOKENIZER_CONFIG_FILE
    return _read_json(file) if file.is_file() else {}


def special_tokens_of(directory: Path, config: dict) -> dict[str, str]:
    """The named special tokens a template sees, as transformers reads them: tokenizer_config.json, else the legacy
    special_tokens_map.json."""
    legacy_file = Path(directory) / "special_tokens_map.json"
    legacy = _read_json(legacy_file) if legacy_file.is_file() else {}
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = _token_text(config.get(name)) or _token_text(legacy.get(name))
        if value is not None:
            tokens[name] = value
    return tokens


def template_files(template: str, special_tokens: dict[str, str]) -> dict[str, bytes]:
    """What carries a template to another directory (a checkpoint, an export) so that it renders there as here, in
    transformers' own file names: the template text (chat_template.jinja) and the named special tokens it reads
    (tokenizer_config.json; with the tokenizer.json beside it, transformers' PreTrainedTokenizerFast loads it)."""
    config = {**special_tokens, "tokenizer_class": "PreTrainedTokenizerFast"}
    return {
        CHAT_TEMPLATE_FILE: template.encode("utf-8"),
        TOKENIZER_CONFIG_FILE: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    }


def has_chat_template(directory: str | os.PathLike | None) -> bool:
    return directory is not None and Path(directory).is_dir() and directory_template_files(directory) != {}


def directory_template_files(directory: str | os.PathLike) -> dict[str, bytes]:
    """`template_files` of a model directory's own template ({} when it has none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    config = tokenizer_config(directory)
    template = directory_template(directory, config)
    return template_files(template, special_tokens_of(directory, config)) if template is not None else {}


def _plain_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages as transformers hands them to the template: keys holding None dropped (templates handle a
    missing key, not a None), and the reasoning aliased under the names templates read."""
    plain = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    return plain


@dataclass
class EncodedChat:
    ids: list[int]
    trained: list[bool]  # per token: part of what the assistant says (its end-of-turn token included)


@dataclass(frozen=True)
class EndOfTurn:
    """What ends the assistant's turn in generation: token ids, and the markers that are no single token of this
    tokenizer (ChatML's `<|im_end|>` on a tokenizer without it), whose text ends the turn."""

    ids: tuple[int, ...]  # the template's marker first, then the eos token's, then the extra ids
    texts: tuple[str, ...]

    def cut(self, text: str) -> str:
        """`text` up to the first marker."""
        ends = [text.find(marker) for marker in self.texts if marker in text]
        return text[: min(ends)] if ends else text

    def ends(self, text: str) -> bool:
        return any(marker in text for marker in self.texts)

    def shown(self, text: str) -> str:
        """What of a turn's text so far can be shown: up to a marker, less an end that may be a marker's start."""
        text = self.cut(text)
        held = [n for marker in self.texts for n in range(1, len(marker)) if text.endswith(marker[:n])]
        return text[: len(text) - max(held, default=0)]


_PROBE = "Probe-answer"  # the assistant text whose rendering shows what the template writes after a turn


class ChatTokenizer:
    """A model directory's tokenizer and chat template: `encode(messages)` gives the ids `apply_chat_template`
    gives and the assistant mask.

    `directory`: where the template (unless `chat_template` chooses one) and the named special tokens are read
    (None: the model carries neither; `chat_template` must name one); `tokenizer_file`: the tokenizer.json (default:
    the directory's); `option`: the setting named in errors."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        chat_template: str | None = None,
        tokenizer_file: str | os.PathLike | None = None,
        option: str = OPTION,
    ):
        self.directory = Path(directory) if directory is not None else None
        tokenizer_file = Path(tokenizer_file) if tokenizer_file is not None else None
        if tokenizer_file is None and self.directory is not None:
            tokenizer_file = self.directory / "tokenizer.json"
        if tokenizer_file is None or not tokenizer_file.is_file():
            raise MTNLGError(f"{tokenizer_file or directory} holds no tokenizer.json (chats are encoded with it)")
        self._tokenizer_file = tokenizer_file
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises plain Exceptions on malformed files
            raise MTNLGError(f"cannot load {tokenizer_file}: {error}") from None
        config = tokenizer_config(self.directory) if self.directory is not None else {}
        self.special_tokens = special_tokens_of(self.directory, config) if self.directory is not None else {}
        self.template_text = resolve_template(self.directory, config, chat_template, option)
        self.template = compile_template(self.template_text)
        self.has_generation_tags = bool(GENERATION_TAG.search(self.template_text))

    def carried_files(self) -> dict[str, bytes]:
        """The template and special tokens as files that carry them elsewhere (`template_files`)."""
        return template_files(self.template_text, self.special_tokens)

    @property
    def tokenizer_file(self) -> str:
        return str(self._tokenizer_file)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        """The id that fills padding positions (never trained, never attended to from a document)."""
        for name in ("pad_token", "eos_token"):
            token = self.special_tokens.get(name)
            if token is not None and self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
        return 0

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, spans: list | None = None) -> str:
        """The template's text for `messages`; with `spans` (a list), the `{% generation %}` spans are added to it."""
        variables = dict(
            messages=_plain_messages(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        if spans is None:
            return self.template.render(**variables)
        blocks: list[str] = []
        with self.template.environment.track_generation(blocks, spans):
            for block in self.template.generate(**variables):
                blocks.append(block)
        return "".join(blocks)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The ids that ask the model for the next assistant turn: `apply_chat_template(messages,
        add_generation_prompt=True)`'s."""
        text = self.render(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def end_of_turn(self, extra_ids: Sequence[int] = ()) -> EndOfTurn:
        """What ends an assistant turn: the text the template writes right after an assistant's words (`<|eot_id|>`,
        `<|im_end|>`, Mistral's eos), the eos token, and `extra_ids` (a generation_config.json's eos ids, the
        end-of-text token). A marker that this tokenizer encodes as one token is its id, any other its text."""
        markers = []
        try:
            rendered = self.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}])
        except Exception:  # noqa: BLE001 - a template that refuses the probe: the eos token alone ends the turn
            rendered = ""
        if _PROBE in rendered:
            after = rendered[rendered.rindex(_PROBE) + len(_PROBE) :].split()
            markers += after[:1]
        if "eos_token" in self.special_tokens:
            markers.append(self.special_tokens["eos_token"])
        ids, texts = [], []
        for marker in markers:
            encoded = self.tokenizer.encode(marker, add_special_tokens=False).ids
            if len(encoded) == 1:
                ids.append(encoded[0])
            else:
                texts.append(marker)
        return EndOfTurn(tuple(dict.fromkeys([*ids, *extra_ids])), tuple(dict.fromkeys(texts)))

    def encode(self, messages: Sequence[dict], train_on: str = "assistant") -> EncodedChat:
        """Ids and mask of one conversation; raises jinja2 / ValueError from the template (the caller names the
        record)."""
        spans: list[tuple[int, int]] = []
        text = self.render(messages, spans=spans if self.has_generation_tags else None)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        if train_on == "all":
            return EncodedChat(list(encoding.ids), [True] * len(encoding.ids))
        if not self.has_generation_tags:
            spans = self._assistant_spans(messages, text)
        return EncodedChat(list(encoding.ids), _tokens_in_spans(encoding.offsets, spans))

    def _assistant_spans(self, messages: Sequence[dict], full: str) -> list[tuple[int, int]]:
        """Each assistant turn's characters by rendering prefixes: what `messages[:i + 1]` adds to `messages[:i]`
        with the generation prompt, less the whitespace after the end-of-turn token."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise ValueError(
                    f"the template renders turn {i + 1} differently once later turns follow (it cannot be masked "
                    f"by rendering prefixes); use a template with {{% generation %}} tags or data.train_on all"
                )
            end = len(through.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return spans


def _tokens_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for each token that overlaps a character span (spans and offsets in order: one pass)."""
    trained = [False] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            trained[index] = True
    return trained
