"""The configs that ship inside the package (models, strategies, the data blend, callbacks, the pipeline), so that
`mtnlg fit --config demo` works from any directory after `pip install`, and so does every command the docs print
(`--config configs/tiny.yaml --trainer.strategy configs/strategy/tp2.yaml`): a value that is not an existing file
but names a shipped config means that config. An existing file always wins."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mtnlg_lightning.errors import InputError

CONFIG_DIR = Path(__file__).with_name("configs")
# The checkout's top-level configs/ and callbacks/ are links into CONFIG_DIR: their paths name the same files.
_CHECKOUT_PREFIXES = ("configs/", "./configs/")

# flags of `mtnlg` whose value is a config file, and the folder a bare name is looked up in besides the top
_CLI_CONFIG_FLAGS = {"--config": "", "-c": "", "--trainer.strategy": "strategy", "--trainer.callbacks": "callbacks"}


def shipped_names() -> list[str]:
    """Every shipped config by the name that selects it: `demo`, `strategy/tp2`, `callbacks/loss_spike`, ..."""
    return sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))


def shipped_config(value: str, folder: str = "") -> Path | None:
    """The shipped config that `value` names (`demo`, `demo.yaml`, `strategy/tp2`, `configs/strategy/tp2.yaml`,
    or, with folder="strategy", plain `tp2`); None when it names none."""
    name = value
    for prefix in _CHECKOUT_PREFIXES:
        name = name.removeprefix(prefix)
    if not name or os.path.isabs(name) or ".." in Path(name).parts:
        return None
    stems = [name, f"{folder}/{name}"] if folder else [name]
    for stem in stems:
        for candidate in (stem, f"{stem}.yaml"):
            path = CONFIG_DIR / candidate
            if path.is_file():
                return path
    return None


def config_path(value: str, folder: str = "", flag: str = "--config") -> str:
    """An existing file as given; else the shipped config of that name (a folder named like one does not hide it);
    else the path as given when something is there (its reader says what is wrong with it); else a one-line error
    that lists the shipped configs."""
    if os.path.isfile(value):
        return value
    shipped = shipped_config(value, folder)
    if shipped is not None:
        return str(shipped)
    if os.path.exists(value):
        return value
    names = [n for n in shipped_names() if n.startswith(f"{folder}/") or not folder and "/" not in n]
    where = f"{flag} {value}" if flag else value
    raise InputError(f"{where}: no such file, and no shipped config of that name (shipped: {', '.join(names)})")


def config_argument(folder: str = ""):
    """An argparse `type=` for a config-file flag (`--strategy`, `--config` of the tools): see config_path."""

    def convert(value: str) -> str:
        try:
            return config_path(value, folder, flag="")
        except InputError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _names_a_file(value: str, folder: str) -> bool:
    """Whether a strategy/callback value means a YAML file rather than a registered name or class path
    (`ddp`, `deepspeed_stage_2`, `mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy`, inline YAML)."""
    if not folder:
        return True
    if value.endswith((".yaml", ".yml")) or value.startswith(_CHECKOUT_PREFIXES) or f"{folder}/" in value:
        return True
    return shipped_config(value, folder) is not None and not value.strip().startswith(("{", "["))


def resolve_cli_args(argv: list[str], registered: set[str] = frozenset()) -> list[str]:
    """`mtnlg` arguments with every config-file value resolved (see config_path). `registered` holds the names the
    framework itself knows for a strategy (Lightning's `ddp`, ...): those stay names."""
    resolved: list[str] = []
    pending: tuple[str, str] | None = None
    for word in argv:
        if pending is not None:
            resolved.append(_resolve_value(word, *pending, registered))
            pending = None
            continue
        flag, eq, value = word.partition("=")
        folder = _CLI_CONFIG_FLAGS.get(flag.removesuffix("+"))
        if folder is None:
            resolved.append(word)
        elif eq:
            resolved.append(f"{flag}={_resolve_value(value, folder, flag, registered)}")
        else:
            resolved.append(word)
            pending = (folder, flag)
    return resolved


def _resolve_value(value: str, folder: str, flag: str, registered: set[str]) -> str:
    inline_yaml = any(mark in value for mark in (":", "{", "\n"))  # jsonargparse also takes a config as text
    if os.path.isfile(value) or value in registered or inline_yaml:
        return value
    if folder == "strategy" and "." not in value and shipped_config(value, folder) is None:
        known = ", ".join(sorted(n for n in registered if "_" not in n))
        raise InputError(
            f"{flag} {value}: neither a strategy name ({known}, ...), "
            "nor a config file, "
            f"nor a shipped config ({', '.join(n for n in shipped_names() if n.startswith('strategy/'))})"
        )
    if not _names_a_file(value, folder):
        return value
    return config_path(value, folder, flag)
