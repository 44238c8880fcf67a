"""`mtnlg`: the LightningCLI entry point (fit / validate / test / predict)."""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from mtnlg_lightning.config import get_config
from mtnlg_lightning.data.datamodule import GPTDataModule, StepDataModule
from mtnlg_lightning.data.finetune import FineTuneDataModule  # noqa: F401 - a known `data` subclass in --help
from mtnlg_lightning.data.preferences import PreferenceDataModule  # noqa: F401 - a known `data` subclass in --help
from mtnlg_lightning.data.prompts import PromptDataModule  # noqa: F401 - a known `data` subclass in --help
from mtnlg_lightning.errors import MTNLGError, one_line, run_main
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.parallel.config import ParallelConfig
from mtnlg_lightning.quick_exit import skip_final_garbage_collection
from mtnlg_lightning.resilience.exit_codes import ExitCode
from mtnlg_lightning.resilience.restart import resolve_ckpt_path
from mtnlg_lightning.shipped_configs import resolve_cli_args
from mtnlg_lightning.train.module import MTNLGModule
from mtnlg_lightning.train.quiet import quiet_known_noise, quiet_resume, quiet_trainer, trainer_arguments

_MISSING_INIT_ARGS = re.compile(
    r'Parser key "(\w+)".*?class_path \'([\w.]+)\': the following arguments are required: ([\w, ]+?)(?: -| Expected|$)'
)


class OneLineParser(LightningArgumentParser):
    """A bad flag or config file is one `mtnlg: error:` line (jsonargparse prints the whole usage, ~70 lines)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        text = " ".join(str(message).split())
        missing = _MISSING_INIT_ARGS.search(text)
        if missing:  # jsonargparse's subclass-union message buries the point ~300 characters in
            key, class_path, names = missing.groups()
            names = ", ".join(f"--{key}.{name.strip()}" for name in names.split(","))
            text = f"{names} required by {class_path.rsplit('.', 1)[-1]} ({key}.class_path)"
        text = text if len(text) <= 400 else text[:397] + "..."
        print(f"mtnlg: error: {text} (mtnlg SUBCOMMAND --help lists the options)", file=sys.stderr)
        sys.exit(2)


class MTNLGCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        """`data` is any `StepDataModule`; without a `class_path` it is the pretraining `GPTDataModule`, so a config's
        plain `data:` keys (and `--data.KEY` flags) keep meaning what they meant."""
        if self.subclass_mode_data:  # a caller may still give one data class (MTNLGCLI(Module, GPTDataModule))
            parser.set_defaults({"data": {"class_path": f"{GPTDataModule.__module__}.{GPTDataModule.__qualname__}"}})

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        config = self.config.get(self.config.get("subcommand")) if self.config.get("subcommand") else self.config
        if config is not None:
            check_finetune_run(config.model, config.data)
            check_parallel_run(config.trainer.strategy, config.model)

    def before_instantiate_classes(self) -> None:
        """`trainer.precision: null` picks the fastest correct precision for the machine (`default_precision`);
        an accelerator this machine does not have is one line before anything is built."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is not None and config.trainer.precision is None:
            config.trainer.precision = default_precision()
        if config is not None:
            check_accelerator(config.trainer.accelerator)

    def instantiate_trainer(self, **kwargs):
        """The Trainer, without the frameworks' messages that mean nothing here (`train/quiet.py`)."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = super().instantiate_trainer(**{**trainer_arguments(config.get("trainer") or {}), **kwargs})
        quiet_trainer(trainer)
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Lightning reads a `ckpt_path` file's hyper-parameters before anything else: an unreadable one is one
        line (a checkpoint folder of this format is read, and checked, by the strategy later)."""
        try:
            super()._parse_ckpt_path()
        except Exception as error:  # noqa: BLE001 - torch.load's errors differ by how the file is broken
            path = self.config[self.config.subcommand].get("ckpt_path")
            raise MTNLGError(f"ckpt_path {path} is not a readable checkpoint ({type(error).__name__})") from None

    def before_fit(self) -> None:
        """`--ckpt_path last` (and, on a restart, no `--ckpt_path`) resumes from the newest complete checkpoint in any
        of the run's checkpoint folders (`resilience/restart.py`)."""
        config = self.config_init[self.subcommand]
        config["ckpt_path"] = resolve_ckpt_path(self.trainer, config.get("ckpt_path"))
        quiet_resume(config["ckpt_path"])


def check_finetune_run(model, data) -> None:
    """What fine-tuning needs, named before a model is built from a preset it was never meant to use."""
    if model.get("init_from"):
        return
    if model.get("lora"):
        raise MTNLGError("model.lora needs model.init_from: the model directory (or checkpoint) the adapter trains on")
    class_path = (data.get("class_path") if data is not None else None) or ""
    init_args = data.get("init_args") if data is not None else None
    if class_path.endswith("FineTuneDataModule") and not (init_args and init_args.get("tokenizer")):
        raise MTNLGError(
            "fine-tuning needs model.init_from: the model directory (or checkpoint) to fine-tune "
            "(or data.tokenizer, to train a fresh model on chat records)"
        )


def check_parallel_run(strategy, model) -> None:
    """The strategy's layout (`parallel.config.ParallelConfig`) checked right after parsing, before the seed line,
    data or processes, as the dry run, the planner and inference check it: its arguments and, for a model the
    config describes, the model's split; then the DeepSpeed a ZeRO stage needs. The world is checked by the
    strategy, once Lightning has counted the devices."""
    spec = strategy.as_dict() if hasattr(strategy, "as_dict") else strategy  # jsonargparse's Namespace
    parallel = ParallelConfig.from_strategy(spec)
    model_config = None  # a model from `init_from` has its architecture in the source: checked once it is read
    if not model.get("init_from"):
        model_config = get_config(model.get("preset", "tiny"), **(model.get("model_overrides") or {}))
    parallel.validate(model_config)
    if parallel.zero_stage >= 1:
        require_extra("deepspeed", f"zero_stage {parallel.zero_stage} (DeepSpeed ZeRO; zero_stage 0 does without it)")


def check_accelerator(accelerator) -> None:
    if not isinstance(accelerator, str) or accelerator == "auto":
        return
    names = ["cuda", "mps"] if accelerator == "gpu" else [accelerator]
    known = list(AcceleratorRegistry.keys())
    if not all(name in known for name in names):
        raise MTNLGError(f"unknown trainer.accelerator {accelerator!r}; choose auto, gpu or one of {', '.join(known)}")

    def available(name: str) -> bool:
        try:
            return bool(AcceleratorRegistry[name]["accelerator"].is_available())
        except Exception:  # noqa: BLE001 - a missing backend package means: not available here
            return False

    if not any(available(name) for name in names):
        raise MTNLGError(f"trainer.accelerator {accelerator}: no such device on this machine (use cpu or auto)")


def default_precision() -> str:
    """bf16-mixed on a GPU with bf16 (as MT-NLG trained); on a CPU, bf16 autocast only where the CPU has native
    bf16 arithmetic (x86 AVX512-BF16 / AMX, Arm BF16): elsewhere it emulates bf16 and fp32 is the faster one
    (measured on the demo: bf16 ~1.7x slower without those instructions, ~1.2x faster with AVX512-BF16)."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if _cpu_has_native_bf16() else "32-true"


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="ignore") as handle:
            flags = set()
            for line in handle:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc, encoding="utf-8", errors="ignore").read()


def main(args: list[str] | None = None) -> int:
    skip_final_garbage_collection()  # quick_exit.py: a quicker exit
    quiet_known_noise()  # quiet.py: the frameworks' warnings that mean nothing here
    if "WANDB_MODE" not in os.environ and not _wandb_configured():
        os.environ["WANDB_MODE"] = "offline"  # no credentials (or no network): keep the run locally

    def body() -> int:
        registered = {"auto", *StrategyRegistry.available_strategies()}
        if args is None:  # the command line, its config names resolved (LightningCLI reads sys.argv itself)
            sys.argv[1:] = resolve_cli_args(sys.argv[1:], registered)
        try:
            cli = MTNLGCLI(
                MTNLGModule,
                StepDataModule,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                args=None if args is None else resolve_cli_args(args, registered),
                parser_class=OneLineParser,
            )
        except MisconfigurationException as error:  # Lightning's word for a bad trainer setting
            raise MTNLGError(one_line(error)) from None
        except UnicodeDecodeError as error:  # a config file in another encoding
            raise MTNLGError(f"a config file is not UTF-8 text ({error.reason} at byte {error.start})") from None
        _destroy_process_group()
        if any(getattr(cb, "stopped_at", None) is not None for cb in cli.trainer.callbacks):
            return ExitCode.PREEMPTED  # saved and stopped on a signal: requeue me (resilience/exit_codes.py)
        return 0

    return run_main("mtnlg", body)


def _destroy_process_group() -> None:
    """Leave no communication threads to the interpreter's exit (they can abort an otherwise finished run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
