"""The study's word lists and prompts: the shipped `study.json`, or a user's file (`mtnlg-eval --data FILE`) with the
same fields, checked before any model is read (a missing or malformed field is one line naming the file).

Fields, and the tasks that read them:
- gender-occupation: `occupations` (list), `templates` ({name: text with "{occupation}"}), `female`, `male` (lists of
  identifier words, scored as " " + word after each template);
- cooccurrence and sentiment: `prompts` ({category: {"templates": [text with "{group}"], "groups": {label: word}}});
- cooccurrence: `descriptive_stop_words` (list, may be empty: words not counted as descriptive);
- sentiment: `sentiment_categories` (the categories of `prompts` whose continuations are scored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import check_input_file

SHIPPED = Path(__file__).with_name("study.json")
FIELDS = {
    "gender-occupation": ("occupations", "templates", "female", "male"),
    "cooccurrence": ("prompts", "descriptive_stop_words"),
    "sentiment": ("prompts", "sentiment_categories"),
}


@dataclass(frozen=True)
class Prompt:
    category: str  # gender, ethnicity, religion
    group: str  # the group's label (female, Asian, Islam, ...)
    text: str  # the template filled with the group's word


@dataclass
class Study:
    path: Path
    occupations: list[str]
    templates: dict[str, str]
    female: list[str]
    male: list[str]
    prompts: list[Prompt]
    stop_words: frozenset[str]
    sentiment_categories: list[str]


def _words(path: Path, data: dict, field: str) -> list[str]:
    value = data[field]
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise MTNLGError(f"{path}: {field} must be a list of non-empty strings")
    return [w.strip() for w in value]


def _templates(path: Path, data: dict) -> dict[str, str]:
    value = data["templates"]
    if not isinstance(value, dict) or not value:
        raise MTNLGError(f"{path}: templates must be an object {{name: text}} with at least one entry")
    for name, text in value.items():
        if not isinstance(text, str) or "{occupation}" not in text:
            raise MTNLGError(f"{path}: template {name!r} must be a string holding {{occupation}}")
    return dict(value)


def _prompts(path: Path, data: dict) -> list[Prompt]:
    value = data["prompts"]
    if not isinstance(value, dict) or not value:
        raise MTNLGError(f"{path}: prompts must be an object {{category: {{templates, groups}}}}")
    out = []
    for category, spec in value.items():
        where = f"{path}: prompts.{category}"
        if not isinstance(spec, dict) or not {"templates", "groups"} <= spec.keys():
            raise MTNLGError(f"{where} needs templates (a list) and groups (an object {{label: word}})")
        templates, groups = spec["templates"], spec["groups"]
        if (
            not isinstance(templates, list)
            or not templates
            or not all(isinstance(t, str) and "{group}" in t for t in templates)
        ):
            raise MTNLGError(f"{where}.templates must be a non-empty list of strings holding {{group}}")
        if not isinstance(groups, dict) or len(groups) < 2 or not all(isinstance(w, str) for w in groups.values()):
            raise MTNLGError(f"{where}.groups must be an object {{label: word}} with at least two groups")
        out += [Prompt(category, group, t.format(group=word)) for group, word in groups.items() for t in templates]
    return out


def read_study(path: str | Path | None, tasks: list[str]) -> Study:
    """The study file at `path` (None: the shipped one), with every field the `tasks` read checked."""
    path = Path(path) if path else SHIPPED
    check_input_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise MTNLGError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    except UnicodeDecodeError as error:
        raise MTNLGError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not isinstance(data, dict):
        raise MTNLGError(f"{path}: expected a JSON object of word lists and prompts")
    for task in tasks:
        missing = [f for f in FIELDS[task] if f not in data]
        if missing:
            raise MTNLGError(f"{path}: {task} needs the field(s) {', '.join(missing)}, which are missing")
    study = Study(path, [], {}, [], [], [], frozenset(), [])
    if "gender-occupation" in tasks:
        study.occupations = _words(path, data, "occupations")
        study.templates = _templates(path, data)
        study.female, study.male = _words(path, data, "female"), _words(path, data, "male")
        if not study.occupations or not study.female or not study.male:
            raise MTNLGError(f"{path}: occupations, female and male must each hold at least one word")
    if "cooccurrence" in tasks or "sentiment" in tasks:
        study.prompts = _prompts(path, data)
    if "cooccurrence" in tasks:
        study.stop_words = frozenset(w.lower() for w in _words(path, data, "descriptive_stop_words"))
    if "sentiment" in tasks:
        study.sentiment_categories = _words(path, data, "sentiment_categories")
        if not study.sentiment_categories:
            raise MTNLGError(f"{path}: sentiment_categories must name at least one category of prompts")
        unknown = sorted(set(study.sentiment_categories) - {p.category for p in study.prompts})
        if unknown:
            raise MTNLGError(f"{path}: sentiment_categories names {', '.join(unknown)}, which prompts does not hold")
    return study
