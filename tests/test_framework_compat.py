"""The private torch, Lightning and DeepSpeed names the project relies on still exist in the installed versions,
and no other module reaches one.

Each name is reached only through `torch_compat.py`, `resilience/elastic_compat.py`, `train/lightning_compat.py` or
`parallel/deepspeed_compat.py` (an override of a private hook lives in the class that overrides it:
`OVERRIDDEN_IN_PLACE`). When a release moves one, the test of that name fails saying which name, which installed
version, and which module to change; when a module reaches a private name of theirs that no table lists, or reaches
one outside those modules, the scan fails naming the file and line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
from functools import cache
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from mtnlg_lightning.parallel import deepspeed_compat
from mtnlg_lightning.parallel.zero import build_deepspeed_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mtnlg_lightning"
TORCH_COMPAT = "src/mtnlg_lightning/torch_compat.py"
ELASTIC_COMPAT = "src/mtnlg_lightning/resilience/elastic_compat.py"
LIGHTNING_COMPAT = "src/mtnlg_lightning/train/lightning_compat.py"
DEEPSPEED_COMPAT = "src/mtnlg_lightning/parallel/deepspeed_compat.py"
COMPAT_MODULES = (TORCH_COMPAT, ELASTIC_COMPAT, LIGHTNING_COMPAT, DEEPSPEED_COMPAT)

# The private torch names torch_compat.py reaches: "module:attribute.path" -> who needs it. `Name()` stands for an
# instance made with no arguments; `name(a, b)` also checks that a callable's first parameters are a, b (our calls
# pass them by position). The overridden hooks are listed too: a rename would silently bypass them.
TORCH_PRIVATE_NAMES = {
    "torch:_grouped_mm": "moe.py (Experts: one GEMM for all experts)",
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal)": (
        "parallel/context_parallel.py (a ring attention block on CPU)"
    ),
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"
    "(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal)": "parallel/context_parallel.py",
    "torch:ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal)": (
        "parallel/context_parallel.py (bf16/fp16 on CUDA)"
    ),
    "torch:ops.aten._scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, "
    "cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset)": (
        "parallel/context_parallel.py"
    ),
    "torch:ops.aten._scaled_dot_product_efficient_attention"
    "(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal)": (
        "parallel/context_parallel.py (fp32 on CUDA)"
    ),
    "torch:ops.aten._scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias, out, "
    "logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal)": "parallel/context_parallel.py",
    "torch._utils:_flatten_dense_tensors(tensors)": "parallel/clip.py (one all-reduce for all gradients)",
    "torch._utils:_unflatten_dense_tensors(flat, tensors)": "parallel/clip.py",
    "torch:_foreach_mul_": "parallel/clip.py (clipping)",
    "torch.distributed._functional_collectives:all_to_all_single_autograd"
    "(self, output_split_sizes, input_split_sizes, group)": "parallel/expert_parallel.py (the dispatch)",
    "torch.distributed._functional_collectives:wait_tensor(tensor)": "parallel/expert_parallel.py",
    "torch.distributed.distributed_c10d:_world.pg_map": "resilience/watchdog.py (every group's timeout)",
    "torch.distributed.distributed_c10d:_set_pg_timeout(timeout, group)": "resilience/watchdog.py",
    "torch.distributed.pipelining:PipelineStage._backward_metadata_inference": (
        "parallel/pipeline.py (overrides it: no loss of ours records torch's shape inference)"
    ),
    "torch.distributed.pipelining:PipelineStage._forward_metadata_inference": (
        "parallel/pipeline.py (overrides it: no forward hook of ours, e.g. QK-clip's, records the placeholders)"
    ),
    "torch.optim:AdamW._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, "
    "state_steps)": "parallel/muon.py (AdamW's step of the groups Muon does not step)",
    "torch.nn:Module()._non_persistent_buffers_set": "model.py (persistent_buffers)",
    "torch.nn:Module._apply(fn, recurse)": "moe.py (MoE overrides it: the expert bias stays fp32 through a cast)",
}
# The private names of torch elastic's agent that elastic_compat.py reaches (its ElasticAgent overrides or calls
# them; `resilience/launch.py`'s ResilientAgent changes them through its hooks).
AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
ELASTIC_PRIVATE_NAMES = {
    f"{AGENT}._assign_worker_ranks(store, group_rank, group_world_size, spec)": (
        "resilience/launch.py (every node agrees on each start)"
    ),
    f"{AGENT}._start_workers(worker_group)": "resilience/launch.py (spare nodes, forwarded signals)",
    f"{AGENT}._stop_workers(worker_group)": "resilience/launch.py (a node joining: time to save)",
    f"{AGENT}._monitor_workers(worker_group)": "resilience/launch.py (the restart policy)",
    f"{AGENT}._shutdown(death_sig, timeout)": "resilience/launch.py (a node joining: time to save)",
    f"{AGENT}._remaining_restarts": "resilience/launch.py (no restart after a configuration error)",
    f"{AGENT}._pcontext": "resilience/launch.py (the workers' processes)",
}
# The private Lightning names lightning_compat.py reaches: "module:attribute.path" -> who needs it. `Name()` stands
# for an instance made with no arguments. The overridden hooks are listed too: a rename would silently bypass them.
LIGHTNING_PRIVATE_NAMES = {
    "lightning.fabric.utilities.distributed:_distributed_is_initialized": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_get_default_process_group_backend_for_device": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_init_dist_connection": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_sync_ddp": "train/strategy.py",
    "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher": "train/strategy.py",
    "lightning.pytorch.strategies:DDPStrategy()._launcher": "train/strategy.py",
    "lightning.pytorch.strategies:ParallelStrategy._configure_launcher": "train/strategy.py (overrides it)",
    "lightning.pytorch.strategies:ParallelStrategy._reset_optimizers_and_schedulers": "train/strategy.py",
    "lightning.pytorch.cli:LightningCLI._parse_ckpt_path": "train/cli.py (overrides it)",
    "lightning.pytorch.callbacks:ModelCheckpoint._find_last_checkpoints": "checkpoint/callback.py (overrides it)",
    "lightning.pytorch:Trainer().fit_loop.epoch_loop.manual_optimization.optim_step_progress": "training_position.py",
    "lightning.pytorch:LightningModule()._trainer": "train/module.py (its model is built outside a Trainer too)",
}
# The private DeepSpeed names deepspeed_compat.py reaches -> the function of it that needs them.
DEEPSPEED_PRIVATE_NAMES = {
    "deepspeed.runtime.engine:DeepSpeedEngine._backward_prologue": "engine_backward",
    "deepspeed.runtime.engine:DeepSpeedEngine._backward_epilogue": "engine_backward",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.clear_backward_seen_flag": "engine_backward",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state": (
        "relink_moment_fragments"
    ),
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer._lazy_init_hp_params_optimizer_state": "relink_moment_fragments",
    "deepspeed.runtime.engine:DeepSpeedEngine._configure_distributed_model": "engine_with_experts",
    "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload._register_deepspeed_module": (
        "whole_parameters_without_hooks"
    ),
    "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP_RANKS": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP_RANKS": "register_expert_groups",
    # the placement ZeRO-3 reads from each expert (mark_expert_parameters): its family's name
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group": (
        "mark_expert_parameters"
    ),
}
# Names set on live objects, checked on a small DeepSpeed engine instead (the last test) -> who needs them. Also
# there: a ZeRO-3 parameter's `ds_id`, `ds_tensor`, `ds_shape` (is_partitioned, local_partition, full_shape) and a
# ZeRO-3 optimizer's `fp32_partitioned_groups_flat` (fp32_flat_partitions), whose names carry no underscore, and the
# ZeRO optimizers' partition bookkeeping that flat_partitions reads (ZeRO-1/2's `single_partition_of_fp32_groups`,
# `bit16_groups`, `real_dp_process_group`; ZeRO-3's `fp16_groups`, `sub_group_process_groups`, `grad_position`).
DEEPSPEED_RUNTIME_ATTRIBUTES = {
    "_running_engine_backward": "engine_backward (an engine's)",
    "_hp_optimizer_states_linked": "relink_moment_fragments (a ZeRO-1/2 optimizer's)",
    "_hp_mapping": "fragment_mapping, has_fragment_mapping (a ZeRO-1/2 parameter's)",
}
# The overrides of a private hook live in the subclass that overrides it: file -> the names it may reach (each
# listed in a table above too).
OVERRIDDEN_IN_PLACE = {
    "src/mtnlg_lightning/train/cli.py": {"_parse_ckpt_path"},
    "src/mtnlg_lightning/checkpoint/callback.py": {"_find_last_checkpoints"},
    "src/mtnlg_lightning/train/strategy.py": {"_configure_launcher"},
    "src/mtnlg_lightning/moe.py": {"_apply"},
}
# Listed names the package relies on without naming them -> how it reaches them.
RELIED_ON_UNNAMED = {
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group": (
        "mark_expert_parameters names the placement family `autoep_expert`, which ZeRO-3 finds this method by"
    ),
}
# Private names of other libraries the scan cannot tell from torch's by their receiver -> who uses them.
NOT_FRAMEWORK_NAMES = {"_fields": "corpora/mirror.py (a named tuple's fields: the standard library's own name)"}
TABLES = {
    "torch": (TORCH_PRIVATE_NAMES, TORCH_COMPAT),
    "torch elastic": (ELASTIC_PRIVATE_NAMES, ELASTIC_COMPAT),
    "lightning": (LIGHTNING_PRIVATE_NAMES, LIGHTNING_COMPAT),
    "deepspeed": (DEEPSPEED_PRIVATE_NAMES, DEEPSPEED_COMPAT),
}
PART = re.compile(r"(\w+)(?:\((.*)\))?")


def resolve(spec: str):
    """`module:Attr.path` with `Name()` meaning an instance made with no arguments, `name(a, b)` a callable whose
    first parameters are a and b (`self` aside), and an attribute missing from a class one its instances get (the
    class declares it or its source reaches `self.name`)."""
    module_name, path = spec.split(":", 1)
    value = importlib.import_module(module_name)
    for part in path.split("."):
        name, parameters = PART.fullmatch(part).groups()
        value = attribute(value, name)
        if parameters == "":
            value = value()
        elif parameters:
            expect_parameters(value, [p.strip() for p in parameters.split(",")])
    return value


def attribute(owner, name: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        if isinstance(owner, type) and any(name in instance_attributes(cls) for cls in owner.__mro__):
            return None
        raise


def instance_attributes(cls: type) -> set[str]:
    """The attributes a class declares or its methods reach on `self` (as its source shows)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    return set(inspect.get_annotations(cls)) | set(re.findall(r"\bself\.(\w+)", source))


def expect_parameters(function, names: list[str]) -> None:
    if isinstance(function, torch._ops.OpOverloadPacket):  # an ATen op: its schema (tests may use private names)
        found = [argument.name for argument in function.default._schema.arguments]
    else:
        found = list(inspect.signature(function).parameters)
        found = found[1:] if found[:1] == ["self"] and names[:1] != ["self"] else found
    if found[: len(names)] != names:
        raise AttributeError(f"its parameters are ({', '.join(found)}), not ({', '.join(names)}, ...)")


def check(spec: str, who: str, distribution: str, compat_module: str) -> None:
    try:
        resolve(spec)
    except (AttributeError, ImportError) as error:
        pytest.fail(
            f"{distribution} {version(distribution)} no longer has {spec} ({error}), which {who} relies on: "
            f"update {compat_module}"
        )


@pytest.mark.parametrize("spec", sorted(TORCH_PRIVATE_NAMES))
def test_each_private_torch_name_exists(spec):
    check(spec, TORCH_PRIVATE_NAMES[spec], "torch", TORCH_COMPAT)


@pytest.mark.parametrize("spec", sorted(ELASTIC_PRIVATE_NAMES))
def test_each_private_name_of_torch_elastic_exists(spec):
    check(spec, ELASTIC_PRIVATE_NAMES[spec], "torch", ELASTIC_COMPAT)


@pytest.mark.parametrize("spec", sorted(LIGHTNING_PRIVATE_NAMES))
def test_each_private_lightning_name_exists(spec):
    check(spec, LIGHTNING_PRIVATE_NAMES[spec], "lightning", LIGHTNING_COMPAT)


@pytest.mark.parametrize("spec", sorted(DEEPSPEED_PRIVATE_NAMES))
def test_each_private_deepspeed_name_exists(spec):
    pytest.importorskip("deepspeed")
    check(spec, DEEPSPEED_PRIVATE_NAMES[spec], "deepspeed", DEEPSPEED_COMPAT)


# ------------------------------------------------------------------------------------------- the scan
# Every private name (one leading underscore) of torch, Lightning or DeepSpeed that the package and its tools reach:
# an import of one, a dotted path through one (`torch._utils._flatten_dense_tensors`, `torch.ops.aten._x`), a
# method of a framework base class overridden or called on `self`/`super()`, an attribute of theirs on any other
# object (a private name this project does not define itself: `engine._backward_prologue`), `getattr` and kin with
# such a name.
SCANNED = (PACKAGE, ROOT / "tools", ROOT / "callbacks")
FRAMEWORKS = ("torch", "lightning", "deepspeed")
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_framework(dotted: str) -> bool:
    return dotted.split(".")[0] in FRAMEWORKS


class Source:
    """One file's tree (each node knows its parent), its classes, and what each name it imports stands for."""

    def __init__(self, path: Path, root: Path):
        self.path, self.where = path, str(path.relative_to(root))
        parts = path.relative_to(PACKAGE.parent if path.is_relative_to(PACKAGE) else root).with_suffix("").parts
        self.module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        self.aliases: dict[str, str] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    self.aliases[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{self.absolute(node)}.{alias.name}"
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        package = self.module.split(".")[: -1 if self.path.name != "__init__.py" else None]
        return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))

    def dotted(self, node: ast.AST) -> str | None:
        """`a.b.c` where `a` is an imported name or a class of this file -> the dotted path it stands for."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        if node.id in self.aliases:
            root = self.aliases[node.id]
        elif node.id in self.classes:
            root = f"{self.module}.{node.id}"
        else:
            return None
        return ".".join([root, *reversed(parts)])

    def enclosing_class(self, node: ast.AST) -> str | None:
        while node is not None and not isinstance(node, ast.ClassDef):
            node = getattr(node, "parent", None)
        return f"{self.module}.{node.name}" if node is not None else None


def import_dotted(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part)
        return value
    raise ImportError(dotted)


@cache
def framework_members(dotted: str) -> frozenset[str]:
    """The private names a framework class and its framework ancestors define or set on their instances."""
    names = set()
    for cls in import_dotted(dotted).__mro__:
        if is_framework(cls.__module__):
            names.update(name for name in vars(cls) if private(name))
            names.update(name for name in instance_attributes(cls) if private(name))
    return frozenset(names)


def receiver_is_self(node: ast.Attribute) -> bool:
    value = node.value
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


class Scan:
    """The private framework names that the Python files below `folders` reach: `uses`, (file, line, name) with a
    dotted path for a module's, a class's and a base class's name, `?._name` for an attribute of another object."""

    def __init__(self, folders: tuple[Path, ...], root: Path = ROOT):
        files = sorted(path for folder in folders if folder.is_dir() for path in folder.rglob("*.py"))
        self.sources = {source.module: source for source in (Source(path, root) for path in files)}
        self.own = self.own_names()
        uses = set()
        for source in self.sources.values():
            for node in ast.walk(source.tree):
                uses.update((source.where, node.lineno, name) for name in self.names_of(source, node))
        self.uses = sorted(uses)

    def framework_bases(self, dotted: str | None, seen: frozenset = frozenset()) -> list[str]:
        """The torch, Lightning and DeepSpeed classes that a class (by its dotted path) is or derives from."""
        if dotted is None or is_framework(dotted):
            return [dotted] if dotted else []
        module, _, name = dotted.rpartition(".")
        source = self.sources.get(module)
        if source is None or name not in source.classes or dotted in seen:
            return []
        bases = [source.dotted(base) for base in source.classes[name].bases]
        return [found for base in bases for found in self.framework_bases(base, seen | {dotted})]

    def framework_owner(self, source: Source, node: ast.AST, name: str) -> str | None:
        """The framework base class, of the class around `node`, that has `name`; None if none has it."""
        bases = self.framework_bases(source.enclosing_class(node))
        return next((base for base in bases if name in framework_members(base)), None)

    def own_names(self) -> set[str]:
        """The private names this project defines itself: functions, classes, variables, arguments, its instances'
        attributes (none that overrides or sets a framework base class's)."""
        names = set()
        for source in self.sources.values():
            for node in ast.walk(source.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    if not self.framework_owner(source, node.parent, node.name):
                        names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.alias) and node.asname:
                    names.add(node.asname)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and receiver_is_self(node):
                    if not self.framework_owner(source, node, node.attr):
                        names.add(node.attr)
        return {name for name in names if private(name)}

    def names_of(self, source: Source, node: ast.AST):
        if isinstance(node, ast.ImportFrom) and is_framework(source.absolute(node)):
            for alias in node.names:
                dotted = f"{source.absolute(node)}.{alias.name}"
                if any(map(private, dotted.split("."))):
                    yield dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_framework(alias.name) and any(map(private, alias.name.split("."))) and not alias.asname:
                    yield alias.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
            if isinstance(node.parent, ast.ClassDef):
                owner = self.framework_owner(source, node.parent, node.name)
                if owner:
                    yield f"{owner}.{node.name}"
        elif isinstance(node, ast.Attribute) and not isinstance(node.parent, ast.Attribute):
            yield from self.attribute_names(source, node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                access = ast.Attribute(value=node.args[0], attr=name.value, ctx=ast.Load())
                access.parent = node
                yield from self.attribute_names(source, access)

    def attribute_names(self, source: Source, node: ast.Attribute):
        """A chain `a.b._c.d`: through an imported framework module or class, up to its last private link; through a
        class of ours, a private name of its framework bases; else each private link that a framework base class of
        `self` has, or that this project does not define."""
        dotted = source.dotted(node)
        if dotted is not None:
            parts = dotted.split(".")
            privates = [i for i, part in enumerate(parts) if private(part)]
            if is_framework(dotted) and privates:
                yield ".".join(parts[: privates[-1] + 1])
            for i in privates if not is_framework(dotted) else ():
                for owner in self.framework_bases(".".join(parts[:i])):
                    if parts[i] in framework_members(owner):
                        yield f"{owner}.{parts[i]}"
            return
        while isinstance(node, ast.Attribute):
            if private(node.attr):
                if receiver_is_self(node):
                    owner = self.framework_owner(source, node, node.attr)
                    if owner:
                        yield f"{owner}.{node.attr}"
                elif node.attr not in self.own:
                    yield f"?.{node.attr}"
            node = node.value


@cache
def package_scan() -> Scan:
    return Scan(SCANNED)


def listed_as(name: str) -> list[tuple[str, str]]:
    """(table, spec) of each table entry that `name` (a dotted path, or `?.attribute`) is."""
    found = []
    for table, (names, _) in TABLES.items():
        for spec in names:
            dotted = re.sub(r"\([^)]*\)", "", spec).replace(":", ".")
            if name.startswith("?."):
                if dotted.rpartition(".")[2] == name[2:]:
                    found.append((table, spec))
            elif dotted == name or dotted.startswith(f"{name}."):
                found.append((table, spec))
    return found


def test_every_private_framework_name_the_package_reaches_is_listed_and_reached_in_a_compat_module():
    compat = set(COMPAT_MODULES)
    unlisted, outside = [], []
    for where, line, name in package_scan().uses:
        attribute = name.rpartition(".")[2]
        known = attribute in DEEPSPEED_RUNTIME_ATTRIBUTES or attribute in NOT_FRAMEWORK_NAMES
        if not known and not listed_as(name):
            unlisted.append(f"{where}:{line} {name}")
        if where not in compat and attribute not in OVERRIDDEN_IN_PLACE.get(where, ()):
            if attribute not in NOT_FRAMEWORK_NAMES:
                outside.append(f"{where}:{line} {name}")
    assert not unlisted, (
        "private framework names no table of tests/test_framework_compat.py lists (reach them in a compat module "
        f"and list them there): {unlisted}"
    )
    assert not outside, f"private framework names reached outside {', '.join(COMPAT_MODULES)}: {outside}"


def test_every_listed_private_name_is_still_reached():
    reached = {entry for *_, name in package_scan().uses for entry in listed_as(name)}
    stale = [
        f"{table}: {spec}"
        for table, (names, _) in TABLES.items()
        for spec in names
        if any(map(private, re.sub(r"\([^)]*\)", "", spec).replace(":", ".").split(".")))
        and (table, spec) not in reached
        and spec not in RELIED_ON_UNNAMED
    ]
    runtime = {name.rpartition(".")[2] for *_, name in package_scan().uses}
    stale += [f"deepspeed runtime: {name}" for name in DEEPSPEED_RUNTIME_ATTRIBUTES if name not in runtime]
    stale += [f"not framework: {name}" for name in NOT_FRAMEWORK_NAMES if name not in runtime]
    assert not stale, f"listed but no longer reached (drop them from the tables): {stale}"


def test_the_scan_finds_each_kind_of_private_name(tmp_path):
    (tmp_path / "probe.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch._dynamo import config\n\n\n"
        "class Layer(nn.Module):\n    def _load_from_state_dict(self, *args):\n"
        "        return self._forward_hooks, self._own\n\n\n"
        "def f(tensor, module):\n    torch._assert(True, 'x')\n    getattr(module, '_parameters')\n"
        "    return tensor._version, tensor._own\n",
        encoding="utf-8",
    )
    assert {name for *_, name in Scan((tmp_path,), root=tmp_path).uses} == {
        "torch._dynamo.config",
        "torch.nn.Module._load_from_state_dict",
        "torch.nn.Module._forward_hooks",
        "torch._assert",
        "?._parameters",
        "?._version",
        "?._own",  # not ours: Layer never sets it
    }


# Internals whose names carry no underscore, which the scan cannot tell from our own names: a plain search.
UNMARKED_INTERNALS = re.compile(
    r"\b(ds_id|ds_tensor|ds_shape|fp32_partitioned_groups_flat|optim_step_progress|subprocess_handlers|pg_map)\b"
)


def test_no_other_module_reaches_the_internals_without_an_underscore():
    compat = {ROOT / path for path in COMPAT_MODULES}
    offenders = [
        str(path.relative_to(ROOT))
        for folder in SCANNED
        for path in sorted(folder.rglob("*.py"))
        if path not in compat and UNMARKED_INTERNALS.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def small_engine(stage: int):
    """A ZeRO engine over a two-layer model after one step (in the world of one process the caller made)."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = build_deepspeed_config(stage, micro_batch_size=1, grad_clip=1.0, precision="32-true")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    engine.backward(engine(torch.ones(1, 8)).sum())
    engine.step()
    return engine


@pytest.mark.slow
def test_the_runtime_attributes_deepspeed_sets_are_where_deepspeed_compat_reads_them(monkeypatch):
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed insists on it, as a launcher would set it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    zero1 = small_engine(stage=1)
    first = next(zero1.module.parameters())
    mapping = deepspeed_compat.fragment_mapping(first)
    assert deepspeed_compat.has_fragment_mapping(first) and mapping is not None
    assert mapping.lp_fragment_address.numel == first.numel()
    assert mapping.get_optim_state_fragment("exp_avg").numel() == first.numel()
    deepspeed_compat.relink_moment_fragments(zero1.optimizer)
    assert zero1.optimizer._hp_optimizer_states_linked
    whole_pieces(deepspeed_compat.flat_partitions(zero1.optimizer))
    assert hasattr(zero1, "_running_engine_backward")
    with deepspeed_compat.engine_backward(zero1):
        pass

    zero3 = small_engine(stage=3)
    partitioned = next(zero3.module.parameters())
    assert deepspeed_compat.is_partitioned(partitioned)
    assert deepspeed_compat.full_shape(partitioned) == (8, 8)
    assert deepspeed_compat.local_partition(partitioned) is not partitioned
    assert deepspeed_compat.fp32_flat_partitions(zero3.optimizer)
    whole_pieces(deepspeed_compat.flat_partitions(zero3.optimizer))


def whole_pieces(partitions) -> None:
    """In a world of one, each flat partition's pieces are its parameters, whole, one after the other."""
    assert partitions
    for partition in partitions:
        sizes = [math.prod(deepspeed_compat.full_shape(p)) for p in partition.params]
        expected = [(index, sum(sizes[:index]), 0, size) for index, size in enumerate(sizes)]
        assert partition.pieces == expected
        assert partition.flat.numel() >= sum(sizes)
