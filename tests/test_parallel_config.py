"""One parallel config (`parallel/config.py`): the trainer, `mtnlg-eval`/`mtnlg-generate --strategy`, the dry run and
the planner read a strategy file the same way and accept or refuse the same layouts with the same one-line message,
whichever of its two import paths the file names the strategy by. Nothing is launched: each is run up to the point
where it would start processes or read weights."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field, fields

import pytest
import yaml
from lightning.pytorch import Trainer

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.launch import check_layout, read_strategy
from mtnlg_lightning.parallel.config import RUNTIME_ARGS, STRATEGY_PATHS, ParallelConfig
from mtnlg_lightning.planning import plan_cli
from mtnlg_lightning.planning.dry_run import dry_run
from mtnlg_lightning.train.cli import check_parallel_run
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

SAME = "as the others"  # inference's verdict, unless the row is about the model's sequence length


@dataclass
class Row:
    name: str
    init_args: dict
    world: int
    refused: str | None  # the start of the one-line message; None: accepted
    preset: str = "tiny"  # 2 blocks, 4 heads, seq_len 64, vocabulary 4096 (a multiple of 128)
    dimensions: dict = field(default_factory=dict)  # what the planner's --layers/--hidden/--heads/--seq can say
    inference: str | None = SAME  # inference pads each request to what SP and CP cut: no sequence-length check

    def model(self) -> dict:
        overrides = dict(self.dimensions)
        if "seq_len" in overrides:
            overrides["max_position_embeddings"] = overrides["seq_len"]  # as mtnlg-plan --seq sets it
        return {"preset": self.preset, "model_overrides": overrides, "micro_batch_size": 1, "global_batch_size": 8}


TP2_PP2 = {"tensor_parallel": 2, "pipeline_parallel": 2, "zero_stage": 0}
TP2_SP_CP2 = {"tensor_parallel": 2, "sequence_parallel": True, "context_parallel": 2, "zero_stage": 0}
INTERLEAVED = {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"}
TP4_ON_NODES_OF_2 = {"tensor_parallel": 4, "gpus_per_node": 2}
ZBV_ZERO2 = {"pipeline_parallel": 2, "pipeline_schedule": "zbv_zero_bubble", "zero_stage": 2}
SIX_HEADS = {"hidden_size": 96, "num_heads": 6}
# fmt: off
ROWS = [
    # accepted
    Row("one process", {"zero_stage": 0}, 1, None),
    Row("tp2 x pp2 x dp2", TP2_PP2, 8, None),
    Row("tp2 with sp x cp2", TP2_SP_CP2, 4, None),
    Row("interleaved pp2", {**INTERLEAVED, "zero_stage": 0}, 2, None, dimensions={"num_layers": 4}),
    Row("explicit first stage", {"pipeline_parallel": 2, "first_stage_layers": 1, "zero_stage": 0}, 2, None,
        dimensions={"num_layers": 3}),
    Row("tp across nodes, allowed", {**TP4_ON_NODES_OF_2, "allow_tp_across_nodes": True, "zero_stage": 0}, 4, None),
    # refused: the arguments
    Row("tp 0", {"tensor_parallel": 0}, 1, "tensor_parallel must be a positive integer, got 0"),
    Row("zero stage 4", {"zero_stage": 4}, 1, "zero_stage 4 is not one of 0 (plain DP), 1, 2, 3"),
    Row("unknown schedule", {"pipeline_parallel": 2, "pipeline_schedule": "zigzag"}, 2,
        "unknown pipeline schedule 'zigzag'; choose one of: 1f1b, gpipe"),
    Row("1f1b with 2 virtual stages", {"pipeline_parallel": 2, "virtual_pipeline_stages": 2}, 2,
        "pipeline_schedule 1f1b takes 1 virtual_pipeline_stages, got 2"),
    Row("zero 3 with pp", {"pipeline_parallel": 2, "zero_stage": 3}, 2,
        "zero_stage 3 partitions parameters a pipeline stage needs whole"),
    Row("zbv with zero 2", ZBV_ZERO2, 2, "pipeline_schedule zbv_zero_bubble splits the backward in two",
        dimensions={"num_layers": 4}),
    Row("sp without tp", {"sequence_parallel": True}, 1,
        "sequence_parallel shards over the tensor-parallel group: it needs tensor_parallel > 1"),
    Row("expert parallel under zero 3", {"expert_parallel": 2, "zero_stage": 3}, 2, None, preset="qwen3-30b-a3b"),
    Row("expert parallel of a dense model", {"expert_parallel": 2, "zero_stage": 0}, 2,
        "expert_parallel 2 needs a mixture-of-experts model"),
    Row("expert parallel beyond dp", {"expert_parallel": 4, "zero_stage": 0}, 2,
        "expert_parallel 4 does not divide the data-parallel size 2", preset="qwen3-30b-a3b"),
    Row("moe in ep2 x tp2", {"expert_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}, 4, None,
        preset="qwen3-30b-a3b"),
    Row("moe in tp2", {"tensor_parallel": 2, "zero_stage": 0}, 2, None, preset="qwen3-30b-a3b"),
    Row("moe in pp2", {"pipeline_parallel": 2, "zero_stage": 0}, 2, None, preset="qwen3-30b-a3b"),
    # refused: the model's split
    Row("heads", {"tensor_parallel": 3}, 3, "num_heads 4 is not divisible by tensor_parallel 3"),
    Row("kv heads", {"tensor_parallel": 3}, 3, "tensor_parallel 3 neither divides num_kv_heads 2 nor is a multiple",
        preset="tiny-llama", dimensions=SIX_HEADS),
    # The model's vocabulary is padded once, to 4096, whatever TP (the dry run once padded it per TP and let it by).
    Row("vocabulary", {"tensor_parallel": 3}, 3, "padded vocabulary 4096 is not divisible by tensor_parallel 3",
        dimensions=SIX_HEADS),
    Row("more stages than blocks", {"pipeline_parallel": 3}, 3,
        "num_layers 2 is fewer than pipeline_parallel 3 stages"),
    Row("more virtual stages than blocks", INTERLEAVED, 2, "4 pipeline stages is more than the model's 2 layers"),
    Row("first stage takes all", {"pipeline_parallel": 2, "first_stage_layers": 2}, 2,
        "first/last stage layers 2/None leave 0 layers for 1 other stages"),
    Row("sp and seq_len", {"tensor_parallel": 2, "sequence_parallel": True}, 2,
        "sequence_parallel: seq_len 63 is not divisible by tensor_parallel 2", dimensions={"seq_len": 63},
        inference=None),
    Row("cp and seq_len", {"context_parallel": 3}, 3, "seq_len 64 is not divisible by 2 x context_parallel = 6",
        inference=None),
    Row("cp with the math kernel", {"context_parallel": 2, "context_parallel_kernel": "math"}, 2,
        "context_parallel needs an attention kernel that returns its log-sum-exp"),
    # refused: the world
    Row("world", {"tensor_parallel": 4}, 6, "world size 6 is not divisible by tensor_parallel 4 x pipeline_parallel 1"),
    Row("tp across nodes", TP4_ON_NODES_OF_2, 4, "tensor_parallel 4 is larger than a node (2 ranks per node)"),
]
# fmt: on


# ------------------------------------------------------------------------------------------- the four readers
def verdict(check) -> str | None:
    try:
        check()
    except MTNLGError as error:
        return str(error)
    return None


def trainer(spec: dict, row: Row) -> str | None:
    """`mtnlg fit`'s checks up to the launch: right after parsing (`check_parallel_run`), then the strategy's own
    before Lightning starts the ranks (`_configure_launcher`, run by the Trainer's constructor)."""

    def check():
        check_parallel_run(spec, row.model())
        module, name = spec["class_path"].rsplit(".", 1)
        strategy = getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))
        Trainer(strategy=strategy, accelerator="cpu", devices=row.world, logger=False, enable_progress_bar=False)

    return verdict(check)


def inference(path, row: Row) -> str | None:
    """`mtnlg-eval`/`mtnlg-generate --strategy FILE --devices N`: the checks before any weight is read."""
    config = get_config(row.preset, **row.model()["model_overrides"])
    return verdict(lambda: check_layout(read_strategy(str(path)), row.world, config))


def dry_run_of(path, tmp_path, row: Row) -> str | None:
    """`mtnlg-dry-run --config FILE` of a config with this strategy on one node of `world` devices."""
    spec = yaml.safe_load(path.read_text())
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"devices": row.world, "strategy": spec}, "model": row.model()}))
    return verdict(lambda: dry_run([str(config)]))


def planner(path, row: Row, capsys) -> str | None:
    """`mtnlg-plan --strategy FILE --gpus N` with the model by its preset and dimensions."""
    flags = {"num_layers": "--layers", "hidden_size": "--hidden", "num_heads": "--heads", "seq_len": "--seq"}
    model = [arg for key, value in row.dimensions.items() for arg in (flags[key], str(value))]
    argv = ["--strategy", str(path), "--gpus", str(row.world), "--gpus-per-node", str(row.world)]
    argv += ["--model", row.preset, *model, "--global-batch", "8", "--micro-batch", "1", "--recompute", "none"]
    capsys.readouterr()
    status = plan_cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    if status == 0:
        return None
    assert status == 2 and len(err) == 1 and err[0].startswith("mtnlg-plan: error: "), err
    return err[0].removeprefix("mtnlg-plan: error: ")


# ------------------------------------------------------------------------------------------- the table
@pytest.mark.parametrize("class_path", STRATEGY_PATHS, ids=["train.strategy", "strategy (pre-round-4 path)"])
@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_every_reader_accepts_and_refuses_the_same_layouts_with_the_same_line(row, class_path, tmp_path, capsys):
    spec = {"class_path": class_path, "init_args": row.init_args}
    path = tmp_path / "strategy.yaml"
    path.write_text(yaml.safe_dump(spec))
    verdicts = {
        "trainer": trainer(spec, row),
        "dry run": dry_run_of(path, tmp_path, row),
        "planner": planner(path, row, capsys),
    }
    for reader, said in verdicts.items():
        if row.refused is None:
            assert said is None, f"{reader} refused: {said}"
        else:
            assert said is not None and said.startswith(row.refused) and "\n" not in said, f"{reader}: {said}"
    assert len(set(verdicts.values())) == 1, verdicts  # the very same line
    expected = verdicts["trainer"] if row.inference == SAME else row.inference
    assert inference(path, row) == expected


def test_other_strategies_are_data_parallel_only_in_every_reader(tmp_path, capsys):
    spec = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {}}
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(spec))
    row = Row("ddp", {}, 2, None)
    assert trainer(spec, row) is None and inference(path, row) is None
    assert dry_run_of(path, tmp_path, row) is None and planner(path, row, capsys) is None
    assert "world 2 = 1 node(s) x 2: pp 1 x dp 2 x tp 1" in dry_run([str(tmp_path / "run.yaml")])
    assert ParallelConfig.from_strategy("ddp") == ParallelConfig.from_strategy(None) == ParallelConfig(zero_stage=0)


def test_a_misspelt_argument_is_one_line_naming_it_wherever_the_file_is_read(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"class_path": STRATEGY_PATHS[1], "init_args": {"tensor_paralel": 2}}))
    with pytest.raises(MTNLGError, match=rf"strategy file {path}.init_args has unknown key\(s\) \['tensor_paralel'\]"):
        read_strategy(str(path))
    row = Row("typo", {}, 2, None)
    assert dry_run_of(path, tmp_path, row).startswith(
        "trainer.strategy.init_args has unknown key(s) ['tensor_paralel']"
    )


def test_the_strategy_takes_exactly_the_layout_and_its_runtime_arguments():
    """The one parser knows every argument the strategy takes, so a file the trainer accepts is read in full."""
    taken = set(inspect.signature(MegatronDeepSpeedStrategy.__init__).parameters) - {"self"}
    assert taken == {f.name for f in fields(ParallelConfig)} | set(RUNTIME_ARGS)
    strategy = MegatronDeepSpeedStrategy(pipeline_parallel=2, pipeline_schedule="looped_bfs", print_layout=False)
    assert strategy.parallel_config == ParallelConfig(pipeline_parallel=2, pipeline_schedule="looped_bfs")
    assert strategy.pipeline_settings.virtual_stages == 2  # the multi-stage schedules' default, in one place


def test_what_the_planner_writes_is_read_back_as_the_layout_it_planned(tmp_path, capsys):
    path = tmp_path / "best.yaml"
    argv = ["--model", "gpt3-1.3b", "--tp", "2", "--pp", "2", "--dp", "4", "--virtual-stages", "2"]
    assert plan_cli.main([*argv, "--global-batch", "64", "--write-config", str(path), "--json"]) == 0
    assert read_strategy(str(path)) == ParallelConfig(
        tensor_parallel=2,
        pipeline_parallel=2,
        pipeline_schedule="interleaved_1f1b",
        virtual_pipeline_stages=2,
        zero_stage=1,
        gpus_per_node=8,
    )
