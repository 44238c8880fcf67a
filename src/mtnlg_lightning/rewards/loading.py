"""Reward functions from a run's settings (TRL's `reward_funcs`, `reward_weights`), loaded once before training.

A spec is one of:
- a shipped name: `accuracy`, `format`, `length` (`rewards.builtin`);
- `package.module:function`: imported (`trl.rewards:think_format_reward`, `my_rewards.math:exact`);
- `path/to/file.py:function`: the file is loaded as a module, which RUNS its code in the training process, by
  design (as importing a package does): name only files you trust. Each file is loaded once a process;
- a mapping `{name: SPEC, KEY: VALUE, ...}`: the function SPEC names with the keyword arguments bound (they win over
  a column of the same name; each must be a named parameter of the function), e.g. `{name: format, pattern:
  '<answer>.*</answer>'}` or `{name: length, target: 64}`; `{factory: SPEC, KEY: VALUE, ...}` instead calls SPEC
  with them once and uses the function it returns (TRL's `get_soft_overlong_punishment`, `get_cosine_scaled_reward`,
  `get_repetition_penalty_reward`). Either may carry `as: NAME`, a display name of its own.

A function's display name (`as`, else its `__name__`) names its metrics `rewards/NAME/mean` and `rewards/NAME/std`, so
two functions need two names. Its weight (default 1.0; any finite number, negative for a penalty) scales its values
in each completion's reward. Whatever does not load is one MTNLGError line naming its spec.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mtnlg_lightning.errors import MTNLGError, one_line
from mtnlg_lightning.rewards.builtin import accuracy, format, length

SHIPPED: dict[str, Callable] = {"accuracy": accuracy, "format": format, "length": length}
# What `score` passes every function itself: a column or a bound argument may not take these names.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")
SPEC_FORMS = "a shipped name (accuracy, format, length), package.module:function, file.py:function or a mapping"


@dataclass(frozen=True)
class RewardFunction:
    name: str  # the display name: metrics rewards/NAME/mean
    function: Callable  # TRL's signature: fn(prompts, completions, completion_ids, **columns) -> list[float | None]
    weight: float
    spec: str  # as the settings wrote it, for messages


@dataclass(frozen=True)
class RewardFunctions:
    """The run's reward functions, in the order of the settings (a reward table's columns)."""

    functions: tuple[RewardFunction, ...]

    def __len__(self) -> int:
        return len(self.functions)

    def __iter__(self) -> Iterator[RewardFunction]:
        return iter(self.functions)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    @property
    def weights(self) -> torch.Tensor:
        """[F] float32, as `grpo_loss.group_advantages` takes them."""
        return torch.tensor([f.weight for f in self.functions], dtype=torch.float32)


class BoundReward:
    """A reward function with keyword arguments bound; they win over the call's (a column of the same name). A class,
    not a closure, so that it pickles."""

    def __init__(self, function: Callable, arguments: dict, name: str):
        self.function, self.arguments, self.__name__ = function, dict(arguments), name

    def __call__(self, *args, **kwargs):
        return self.function(*args, **{**kwargs, **self.arguments})


def describe_error(error: BaseException, source: str | None = None) -> str:
    """`Type: first line (file.py:LINE)`: what a user's code raised and where: the innermost line of the file
    `source` (the function's or the loaded file's), else the innermost line of all."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{type(error).__name__}: {one_line(error)} ({Path(error.filename).name}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if source is not None and Path(frame.filename) == Path(source)]
    frame = (own or frames or [None])[-1]
    place = f" ({Path(frame.filename).name}:{frame.lineno})" if frame is not None else ""
    return f"{type(error).__name__}: {one_line(error)}{place}"


def source_file(function: Callable) -> str | None:
    """The file that defines a reward function (a bound one's function; a callable object's class)."""
    function = function.function if isinstance(function, BoundReward) else function
    target = function if inspect.isfunction(function) or inspect.ismethod(function) else type(function)
    try:
        return inspect.getsourcefile(target)
    except TypeError:  # defined in C
        return None


def name_of(function: Callable) -> str:
    """A function's display name: its `__name__` (a partial's function's), else its class's name."""
    inner = getattr(function, "func", None)
    return getattr(function, "__name__", None) or getattr(inner, "__name__", None) or type(function).__name__


def _import_module(name: str, spec: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(f"{error.name}.")):
            raise MTNLGError(f"reward function {spec}: no module named {error.name}") from None
        raise MTNLGError(f"reward function {spec}: importing {name} fails: {describe_error(error)}") from None
    except Exception as error:  # noqa: BLE001 - the user's module, whatever it raises: one line
        raise MTNLGError(f"reward function {spec}: importing {name} fails: {describe_error(error)}") from None


def _load_file(path: str, spec: str):
    """The module of a .py file, loaded once a process (under a name of its own, so that two files named alike
    do not meet)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise MTNLGError(f"reward function {spec}: no file {path}")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", file.stem)
    name = f"_mtnlg_rewards_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise MTNLGError(f"reward function {spec}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file, whatever it raises: one line
        del sys.modules[name]
        raise MTNLGError(f"reward function {spec}: loading {path} fails: {describe_error(error, str(file))}") from None
    return module


def resolve(spec: str) -> Callable:
    """The callable a string spec names (a shipped name, package.module:function or file.py:function)."""
    if spec in SHIPPED:
        return SHIPPED[spec]
    owner_name, colon, attribute = spec.rpartition(":")
    if not colon or not owner_name or not attribute:
        raise MTNLGError(f"reward function {spec!r} is none of {SPEC_FORMS}")
    is_file = owner_name.endswith(".py") or "/" in owner_name or "\\" in owner_name
    owner = _load_file(owner_name, spec) if is_file else _import_module(owner_name, spec)
    value = owner
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise MTNLGError(f"reward function {spec}: {owner_name} has no {attribute}")
        value = getattr(value, part)
    if not callable(value):
        raise MTNLGError(f"reward function {spec}: {attribute} is {type(value).__name__}, not a function")
    return value


def _named_parameters(function: Callable) -> list[str] | None:
    """The parameters a keyword can fill (None when Python cannot tell)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds]


def _check_arguments(function: Callable, arguments: dict, spec: str) -> None:
    given = [key for key in arguments if key in CALL_ARGUMENTS]
    if given:
        raise MTNLGError(f"reward function {spec}: {', '.join(given)} cannot be bound (the run passes it)")
    named = _named_parameters(function)
    unknown = [key for key in arguments if named is not None and key not in named]
    if unknown:
        raise MTNLGError(
            f"reward function {spec}: {name_of(function)} has no parameter {', '.join(unknown)} (its parameters: "
            f"{', '.join(named) or 'none'})"
        )


def load_one(spec: str | dict) -> tuple[str, Callable, str]:
    """(display name, function, spec as text) of one spec."""
    if isinstance(spec, str):
        function = resolve(spec)
        return name_of(function), function, spec
    if not isinstance(spec, dict):
        raise MTNLGError(f"reward function {spec!r} is {type(spec).__name__}: expected {SPEC_FORMS}")
    text = ", ".join(f"{key}: {value}" for key, value in spec.items())
    text = f"{{{text}}}"
    kind = [key for key in ("name", "factory") if key in spec]
    if len(kind) != 1 or not isinstance(spec[kind[0]], str):
        raise MTNLGError(f"reward function {text}: a mapping names its function by name: SPEC or factory: SPEC")
    display = spec.get("as")
    if display is not None and not (isinstance(display, str) and display):
        raise MTNLGError(f"reward function {text}: as must be a non-empty name, got {display!r}")
    arguments = {key: value for key, value in spec.items() if key not in ("name", "factory", "as")}
    target = resolve(spec[kind[0]])
    _check_arguments(target, arguments, text)
    if kind[0] == "name":
        name = display or name_of(target)
        return name, BoundReward(target, arguments, name) if arguments else target, text
    try:
        function = target(**arguments)
    except Exception as error:  # noqa: BLE001 - the user's factory, whatever it raises: one line
        raise MTNLGError(
            f"reward function {text}: the factory fails: {describe_error(error, source_file(target))}"
        ) from None
    if not callable(function):
        raise MTNLGError(f"reward function {text}: the factory returns {type(function).__name__}, not a function")
    return display or name_of(function), function, text


def _is_weight(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def load_rewards(
    specs: Sequence[str | dict] | str | dict | None, weights: Sequence[float] | None = None
) -> RewardFunctions:
    """The reward functions `specs` name (the forms in this module's description; one spec alone may stand without a
    list), weighted by `weights` (one number each; default 1.0 each). Loading a file or module runs its code."""
    if isinstance(specs, str | dict):
        specs = [specs]
    if not specs:
        raise MTNLGError(f"no reward functions: GRPO scores its completions with at least one ({SPEC_FORMS})")
    loaded = [load_one(spec) for spec in specs]
    if weights is None:
        weights = [1.0] * len(loaded)
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence) or len(weights) != len(loaded):
        count = len(weights) if isinstance(weights, Sequence) else weights
        raise MTNLGError(f"reward weights: {count} given for {len(loaded)} reward functions (one number each)")
    for weight in weights:
        if not _is_weight(weight):
            raise MTNLGError(f"reward weights must be finite numbers, got {weight!r}")
    names = [name for name, _, _ in loaded]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise MTNLGError(
            f"two reward functions are named {', '.join(twice)} (their metrics would mix): give one its own with "
            "{name: SPEC, as: NAME}"
        )
    return RewardFunctions(
        tuple(
            RewardFunction(name, function, float(weight), text)
            for (name, function, text), weight in zip(loaded, weights, strict=True)
        )
    )
