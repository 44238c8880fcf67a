"""Inference in a layout reproduces one process: a checkpoint trained in one process and one trained in tp2 x pp2 x
dp2 are each evaluated with `mtnlg-eval --strategy` tp2 (2 ranks), pp2 (2 ranks) and tp2 x pp2 x dp2 (8 ranks):
LAMBADA 0/3-shot, HANS, perplexity and a harness task give the same accuracies and perplexities within rel 1e-5 of
single-process `mtnlg-eval`; greedy generation of prompts of different lengths gives the single-process tokens;
seeded sampling is the same on every rank and across runs. Bad layouts and checkpoints are one line, before any
weight is read. One launch per layout runs every check (tests/dist_inference_runs.py)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from conftest import ROOT
from dist_inference_runs import NEW_TOKENS, PROMPTS, tasks
from test_evaluation import checkpoint, cloze, harness_task_dir, tokenizer_path  # noqa: F401 - fixtures
from tiny_runs import tiny_checkpoint as trained_tiny_checkpoint

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model
from testing.run_watch import run as watched_run

HANS = ROOT / "tests" / "data" / "hans_sample.jsonl"
LAYOUTS = {
    "tp2": ("configs/strategy/tp2.yaml", 2),
    "pp2": ("configs/strategy/pp2.yaml", 2),
    "tp2xpp2xdp2": ("configs/strategy/tp2_pp2_dp2.yaml", 8),
}


@pytest.fixture(scope="module")
def inputs(cloze, tokenizer_path, tmp_path_factory):  # noqa: F811
    """The files every run reads: (argument namespace-like dict of the driver's task files)."""
    directory = tmp_path_factory.mktemp("inference_inputs")
    text = directory / "valid.txt"
    text.write_text("\n\n".join(json.loads(line)["sentence1"] for line in open(HANS)) + "\nThe end of the file.\n")
    task_dir = harness_task_dir(directory / "tasks", cloze)
    return dict(tokenizer=tokenizer_path, cloze=str(cloze), hans=str(HANS), text=str(text), task_dir=str(task_dir))


@pytest.fixture(scope="module")
def checkpoints(checkpoint, tmp_path_factory):  # noqa: F811
    return {"single": checkpoint, "tp2xpp2xdp2": trained_tiny_checkpoint(tmp_path_factory, "tp2xpp2xdp2")}


@pytest.fixture(scope="module")
def references(checkpoints, inputs, tmp_path_factory):
    """Single-process `mtnlg-eval` of every task and greedy `generate` of every prompt, per checkpoint."""
    out = tmp_path_factory.mktemp("reference")
    args = type("Args", (), inputs)
    tokenizer = Tokenizer(inputs["tokenizer"])
    found = {}
    for name, path in checkpoints.items():
        base = ["--checkpoint", str(path), "--tokenizer", inputs["tokenizer"], "--no-progress", "--dtype", "fp32"]
        found[name] = {}
        for task, argv in tasks(args).items():
            assert eval_main([*base, "--batch-size", "8", *argv, "--output", str(out / f"{name}_{task}.json")]) == 0
            found[name][task] = json.loads((out / f"{name}_{task}.json").read_text())["results"]
        model, _ = load_model(path)
        found[name]["greedy"] = [
            generate(model, tokenizer.encode(p), NEW_TOKENS, temperature=0, eos_id=tokenizer.eod_id).tokens[0]
            for p in PROMPTS
        ]
    return found


def assert_same_results(ours: dict, reference: dict, where: str) -> None:
    """Accuracies equal, perplexities (and losses) within rel 1e-5, counts equal."""
    assert ours.keys() == reference.keys(), where
    for task, settings in reference.items():
        for setting, metrics in settings.items():
            mine = ours[task][setting]
            for key, value in metrics.items():
                label = f"{where} {task} {setting} {key}"
                if key.startswith("acc") or isinstance(value, (int, str)):
                    assert mine[key] == value, label
                else:
                    assert mine[key] == pytest.approx(value, rel=1e-5), label


@pytest.mark.distributed
@pytest.mark.timeout(1800)  # two checkpoints x five evaluations and generation in one launch, on a busy machine
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_evaluation_and_generation_equal_one_process(layout, checkpoints, inputs, references, tmp_path):
    strategy, devices = LAYOUTS[layout]
    command = [sys.executable, str(ROOT / "tests" / "dist_inference_runs.py"), str(tmp_path)]
    command += ["--strategy", strategy, "--devices", str(devices)]
    command += [x for name, path in checkpoints.items() for x in ("--checkpoint", f"{name}={path}")]
    command += [x for key, value in inputs.items() for x in (f"--{key.replace('_', '-')}", value)]
    run = watched_run(command, tmp_path / "logs", layout, progress=[tmp_path], cwd=ROOT)  # no fixed timeout
    assert run.returncode == 0, run.stderr[-3000:]
    for name in checkpoints:
        reference = references[name]
        for task in ("lambada", "hans", "perplexity", "harness"):
            written = json.loads((tmp_path / f"{name}_{task}.json").read_text())
            assert_same_results(written["results"], reference[task], f"{name} in {layout}:")
            assert written["settings"]["layout"]["world_size"] == devices
        lambada = reference["lambada"]["lambada"]
        assert 0 < lambada["0"]["acc"] < 1  # a non-trivial accuracy, so equality means something
        generation = json.loads((tmp_path / f"{name}_generation.json").read_text())
        assert generation["greedy"] == reference["greedy"], f"{name} in {layout}"
        first_run, second_run = generation["sampled_by_rank"][0]
        assert first_run == second_run  # seeded: the same tokens twice
        assert all(rank_runs == [first_run, first_run] for rank_runs in generation["sampled_by_rank"])
        assert first_run != generation["greedy"]  # sampling, not argmax
        if layout == "tp2xpp2xdp2":
            assert written["settings"]["layout"] == {
                "world_size": 8,
                "tensor_parallel": 2,
                "pipeline_parallel": 2,
                "data_parallel": 2,
                "context_parallel": 1,
                "pipeline_schedule": "1f1b",
                "virtual_pipeline_stages": 1,
                "sequence_parallel": False,
            }


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_generate_and_eval_print_the_same_bytes_in_one_process_and_in_tp2_x_pp2(checkpoint, inputs, tmp_path, capfd):  # noqa: F811
    tp2_pp2 = tmp_path / "tp2_pp2.yaml"
    tp2_pp2.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\n"
        "init_args: {tensor_parallel: 2, pipeline_parallel: 2}\n"
    )
    common = ["--checkpoint", str(checkpoint), "--tokenizer", inputs["tokenizer"], "--dtype", "fp32"]
    sampling = ["--prompt", PROMPTS[1], "--max-new-tokens", "12", "--num-samples", "2", "--temperature", "0.8"]
    scoring = ["--no-progress", "--task", "lambada", "--data", inputs["cloze"], "--shots", "0", "1"]
    printed = {}
    for layout, where in {"one process": [], "tp2 x pp2": ["--strategy", str(tp2_pp2), "--devices", "4"]}.items():
        assert generate_main([*common, *sampling, "--seed", "7", *where]) == 0
        assert eval_main([*common, *scoring, *where, "--output", str(tmp_path / "results.json")]) == 0
        printed[layout] = capfd.readouterr().out
    assert "--- prompt 1 sample 2 ---" in printed["one process"] and "lambada 1-shot" in printed["one process"]
    assert printed["tp2 x pp2"] == printed["one process"]


def test_bad_layouts_and_checkpoints_are_one_line_before_any_weight_is_read(checkpoint, tmp_path, capsys):  # noqa: F811
    tp3 = tmp_path / "tp3.yaml"
    tp3.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\ninit_args: {tensor_parallel: 3}\n"
    )
    pp3 = tmp_path / "pp3.yaml"
    pp3.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\ninit_args: {pipeline_parallel: 3}\n"
    )
    other = tmp_path / "other_shape.ckpt"
    shutil.copytree(checkpoint, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model_config"]["vocab_size"] = 4000  # the tensors are those of a vocabulary of 4096
    (other / "manifest.json").write_text(json.dumps(manifest))
    for weights in other.glob("*.safetensors"):
        weights.write_bytes(b"")  # any read of a weight would fail differently
    tp2 = "configs/strategy/tp2.yaml"
    cases = [
        ([str(checkpoint), str(tp3), "3"], "num_heads 4 is not divisible by tensor_parallel 3"),
        ([str(checkpoint), str(pp3), "3"], "num_layers 2 is fewer than pipeline_parallel 3 stages"),
        # the trainer's message (parallel/config.py): inference checks a layout as `mtnlg fit` does
        ([str(checkpoint), tp2, "3"], "world size 3 is not divisible by tensor_parallel 2 x pipeline_parallel 1 = 2"),
        ([str(other), tp2, "2"], f"checkpoint {other}: embed.wte.weight has shape [4096, 64], but its model_config"),
    ]
    for (path, strategy, devices), message in cases:
        argv = ["--checkpoint", path, "--strategy", strategy, "--devices", devices]
        assert eval_main([*argv, "--task", "lambada", "--data", str(HANS)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mtnlg-eval: error: {message}"), err
        assert generate_main([*argv, "--prompt", "The"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mtnlg-generate: error: {message}"), err
