"""tools/plan.py: memory accounting (ZeRO, recompute, sequence parallelism), the cost model's breakdown, search,
--write-config, bad input; the GPU check's CPU smoke mode."""

import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, run_cli

from mtnlg_lightning.config import ModelConfig, get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.gpus import GPUS, get_gpu, load_gpu_specs
from mtnlg_lightning.planning.cost_model import IMPLEMENTATIONS, _layer_gemm_shapes
from mtnlg_lightning.planning.planner import activation_bytes_per_layer, model_state_bytes, plan, search
from mtnlg_lightning.train.flops import flops_per_iteration

MTNLG = get_config("mtnlg-530b")
PLAN = [sys.executable, str(ROOT / "tools/plan.py")]


def tflops_from_time(config: ModelConfig, global_batch: int, seconds: float, gpus: int) -> float:
    """Achieved TFLOP/s per GPU from a measured iteration time (how the paper reports throughput)."""
    return flops_per_iteration(config, global_batch, recompute=True) / seconds / gpus / 1e12


def run_plan(*args):
    return subprocess.run([*PLAN, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("nodes,seconds,reported", [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)])
def test_planner_reproduces_the_papers_tflops_from_its_iteration_times(nodes, seconds, reported):
    assert tflops_from_time(MTNLG, 1920, seconds, nodes * 8) == pytest.approx(reported, rel=0.02)


def test_the_papers_530b_layout_fits_in_80gb_with_3_layers_per_stage():
    p = plan(MTNLG, 8, 35, 16, 8, "a100-80g", 1920, micro_batch=1, recompute="full", zero_stage=1)
    assert p.layers_per_stage == [3] * 35
    assert p.fits and p.total_gb < 80 and p.tp_within_node
    assert p.num_microbatches == 120
    assert 1.9e9 < p.params_per_gpu < 2.2e9  # 530B / 280 model-parallel GPUs, plus the embedding shard


def test_530b_without_recompute_and_without_zero_does_not_fit():
    p = plan(MTNLG, 8, 35, 8, 8, "a100-80g", 1920, recompute="none", zero_stage=0)
    assert not p.fits


def test_model_states_are_20_bytes_per_parameter_and_zero_shards_them():
    assert model_state_bytes(1000, dp=1, zero_stage=0) == 20_000
    assert model_state_bytes(1000, dp=4, zero_stage=1) == 1000 * (2 + 6 + 12 / 4)
    assert model_state_bytes(1000, dp=4, zero_stage=2) == 1000 * (2 + (6 + 12) / 4)
    assert model_state_bytes(1000, dp=4, zero_stage=3) == 20_000 / 4


def test_activation_memory_follows_korthikanti_with_and_without_sequence_parallelism():
    s, b, h, a, t = MTNLG.seq_len, 1, MTNLG.hidden_size, MTNLG.num_heads, 8
    sbh = s * b * h
    no_tp = activation_bytes_per_layer(MTNLG, b, 1, "none")
    assert no_tp == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(MTNLG, b, t, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    with_sp = activation_bytes_per_layer(MTNLG, b, t, "none", sequence_parallel=True)
    assert with_sp == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(MTNLG, b, t, "selective", sequence_parallel=True) == pytest.approx(sbh * 34 / t)
    # SP at TP 1 is no SP.
    assert activation_bytes_per_layer(MTNLG, b, 1, "none", sequence_parallel=True) == pytest.approx(no_tp)


def test_sequence_parallelism_cuts_the_530b_activation_memory_per_gpu():
    kwargs = dict(micro_batch=1, recompute="selective", zero_stage=1)
    without = plan(MTNLG, 8, 35, 16, 8, "a100-80g", 1920, **kwargs)
    with_sp = plan(MTNLG, 8, 35, 16, 8, "a100-80g", 1920, **kwargs, sequence_parallel=True)
    assert with_sp.activation_gb < 0.6 * without.activation_gb
    assert with_sp.model_state_gb == without.model_state_gb


def test_breakdown_adds_up_and_each_part_appears_only_where_its_parallelism_does():
    config = get_config("gpt3-175b")
    single = plan(config, 1, 1, 1, 8, "h100", 8, recompute="none", zero_stage=0)
    b = single.breakdown
    assert b["tp_comm"] == b["pp_comm"] == b["bubble"] == b["dp_comm"] == b["recompute"] == 0
    assert single.iteration_seconds == pytest.approx(b["compute"] + b["optimizer"])

    full = plan(config, 8, 8, 4, 8, "h100", 512, recompute="full", zero_stage=1)
    b = full.breakdown
    assert min(b["tp_comm"], b["pp_comm"], b["bubble"], b["dp_comm"], b["recompute"]) > 0
    assert full.iteration_seconds == pytest.approx(sum(v for k, v in b.items() if k not in ("total", "recompute")))
    # Full recompute re-runs each layer's forward (a third of its forward + backward: 1/4 of all layer work);
    # the LM head and the gradient accumulation are not recomputed, so a little less overall.
    assert 0.15 < b["recompute"] / b["compute"] <= 0.25


def test_interleaving_shrinks_the_bubble_by_the_number_of_chunks_and_multiplies_the_sends():
    config = get_config("gpt3-175b")
    one = plan(config, 8, 8, 1, 8, "a100-80g", 64, virtual_stages=1)
    three = plan(config, 8, 8, 1, 8, "a100-80g", 64, virtual_stages=3)
    busy = lambda p: (p.breakdown["compute"] + p.breakdown["tp_comm"]) / p.num_microbatches  # noqa: E731
    # One stage-boundary send: a micro-batch's activations (this trainer sends them whole) over the NIC, as the
    # stages (TP 8 each) are whole nodes. Fill and drain cross the 7 boundaries forward and backward in turn.
    gpu = get_gpu("a100-80g")
    send = 2048 * 12288 * 2 / (gpu.network_gbps * gpu.network_efficiency * 1e9)
    assert one.breakdown["bubble"] == pytest.approx(7 * busy(one) + 2 * 7 * send)
    assert three.breakdown["bubble"] == pytest.approx(7 / 3 * busy(three) + 2 * 7 * send)
    # Steady state: 2 sends per micro-batch and chunk (Narayanan et al.: v times the traffic); the tied embedding's
    # all-reduce between the first and last stage is the same in both.
    assert three.breakdown["pp_comm"] - one.breakdown["pp_comm"] == pytest.approx(64 * 2 * 2 * send)
    assert one.breakdown["pp_comm"] > 64 * 2 * send


def test_smaller_tp_shards_run_below_peak_and_tp_costs_communication():
    gpu = get_gpu("a100-80g")
    assert gpu.gemm_fraction(20480 / 8) > gpu.gemm_fraction(2048 / 8) > gpu.gemm_fraction(2048 / 16)
    config = get_config("gpt3-1.3b")
    tp1, tp8 = (plan(config, t, 1, 1, 8, "a100-80g", 16, recompute="none", zero_stage=0) for t in (1, 8))
    assert tp8.breakdown["tp_comm"] > 0 == tp1.breakdown["tp_comm"]
    assert tp8.iteration_seconds * 8 > tp1.iteration_seconds  # 8 GPUs on one model are less than 8x faster


def test_gemm_efficiency_follows_each_gemms_own_narrowest_dimension():
    config = ModelConfig(num_layers=40, hidden_size=6144, num_heads=48, seq_len=2048, vocab_size=51200, name="18b")
    h, t = 6144, 8
    # QKV and FC1 are column-parallel (N = 3h/t, 4h/t), the projection and FC2 row-parallel (K = h/t, 4h/t): only the
    # projection, 1/12 of the layer's GEMM FLOPs, is as narrow as h/t.
    assert [min(k, n) for k, n in _layer_gemm_shapes(config, t)] == [3 * h / t, h / t, 4 * h / t, 4 * h / t]
    assert [min(k, n) for k, n in _layer_gemm_shapes(config, 1)] == [h] * 4
    gpu = get_gpu("a100-80g")
    flops = sum(k * n for k, n in _layer_gemm_shapes(config, t))
    mean = flops / sum(k * n / gpu.gemm_fraction(min(2048, k, n)) for k, n in _layer_gemm_shapes(config, t))
    assert gpu.gemm_fraction(h / t) < mean < gpu.gemm_fraction(2048)


def test_megatron_searches_only_pipelines_megatron_can_run():
    megatron, ours = IMPLEMENTATIONS["megatron-2021"], IMPLEMENTATIONS["mtnlg-lightning"]
    assert not megatron.runs_pipeline(48, 2, 2)  # no interleaved schedule on 2 stages
    assert not megatron.runs_pipeline(40, 4, 4)  # 40 layers are not 16 equal chunks
    assert not megatron.runs_pipeline(36, 8, 1)  # nor 8 equal stages
    assert megatron.runs_pipeline(40, 4, 2) and megatron.runs_pipeline(48, 2, 1) and megatron.runs_pipeline(40, 1, 1)
    assert ours.runs_pipeline(40, 4, 4) and ours.runs_pipeline(36, 8, 1) and ours.runs_pipeline(48, 2, 2)
    config = ModelConfig(num_layers=40, hidden_size=6144, num_heads=48, seq_len=2048, vocab_size=51200, name="18b")
    runnable = lambda p: config.num_layers % (p.pp * p.virtual_stages) == 0 and (p.virtual_stages == 1 or p.pp > 2)  # noqa: E731
    plans = search(config, 256, 8, "a100-80g", 1024, implementation="megatron-2021")
    assert plans and all(runnable(p) for p in plans)
    assert not all(runnable(p) for p in search(config, 256, 8, "a100-80g", 1024))  # this trainer splits unevenly


def test_gpu_table_has_the_four_gpus_and_unknown_names_list_them(tmp_path):
    assert {"a100-40g", "a100-80g", "h100", "h200"} <= set(GPUS)
    assert get_gpu("h200").memory_gb > get_gpu("h100").memory_gb and get_gpu("a100").memory_gb == 80
    with pytest.raises(MTNLGError, match=r"unknown gpu 'v100'; known GPUs: a100, a100-40g, a100-80g, h100"):
        get_gpu("v100")
    spec = tmp_path / "gpus.yaml"
    spec.write_text("b200: {peak_tflops: 2250, memory_gb: 180, hbm_tbps: 8, nvlink_gbps: 900, network_gbps: 50}\n")
    extra = load_gpu_specs(spec)
    assert get_gpu("b200", extra).peak_tflops == 2250 and get_gpu("b200", extra).gemm_efficiency > 0
    spec.write_text("b200: {peak_tflops: 2250}\n")
    with pytest.raises(MTNLGError, match="lacks"):
        load_gpu_specs(spec)


def test_invalid_layouts_are_errors_naming_the_numbers():
    assert not plan(MTNLG, 16, 35, 1, 8, "a100-80g", 1920).tp_within_node
    with pytest.raises(MTNLGError, match="num_heads 128 is not divisible by tensor_parallel 3"):
        plan(MTNLG, 3, 35, 1, 8, "a100-80g", 1920)
    with pytest.raises(
        MTNLGError, match="pipeline_parallel 106 x virtual stages 1 is more stages than the model's 105"
    ):
        plan(MTNLG, 8, 106, 1, 8, "a100-80g", 1920)
    with pytest.raises(MTNLGError, match="global batch 1920 is not divisible by micro_batch 1 x dp 7"):
        plan(MTNLG, 8, 35, 7, 8, "a100-80g", 1920)


def test_search_of_1_3b_on_16_gpus_does_not_pick_tp8_and_its_top_layouts_differ_in_time():
    plans = search(get_config("gpt3-1.3b"), num_gpus=16, gpus_per_node=8, gpu="a100-80g", global_batch=512)
    assert plans and all(p.fits and p.tp_within_node and p.gpus == 16 for p in plans)
    times = [p.iteration_seconds for p in plans]
    assert times == sorted(times)
    assert plans[0].tp < 8
    assert len({round(t, 4) for t in times[:10]}) == 10
    assert plans[-1].iteration_seconds > 1.5 * plans[0].iteration_seconds  # a bad layout is visibly slower


def test_plan_cli_prints_every_figure_with_the_breakdown_and_the_rampup():
    out = run_plan(
        *("--model", "mtnlg-530b", "--tp", "8", "--pp", "35", "--dp", "16", "--gpu", "a100-80g"),
        *("--global-batch", "1920", "--micro-batch", "1", "--recompute", "full", "--rampup", "32", "32", "5859375"),
    )
    assert out.returncode == 0, out.stderr
    for text in (
        "layers per stage     3 (1F1B)",
        "params per GPU",
        "model states",
        "activations",
        "fits",
        "TP inside a node     yes",
        "pipeline bubble",
        "FLOPs per iteration",
        "TFLOP/s per GPU",
        "time breakdown       compute",
        "TP comm",
        "bubble",
        "batch ramp-up        14,475 steps",
    ):
        assert text in out.stdout


def test_plan_cli_search_explains_its_top_layouts_and_takes_a_model_by_dimensions():
    out = run_plan(*("--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048", "--vocab", "50257"),
                   *("--gpus", "16", "--global-batch", "512", "--search", "--explain", "2"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "layouts of 16 x a100-80g fit custom" in out.stdout
    why = out.stdout.split("why (time per iteration on the slowest pipeline stage):")[1].strip().splitlines()
    assert len(why) == 2 and all(line.strip().startswith(f"#{i}: compute") for i, line in enumerate(why, 1))
    out = run_plan("--model", "gpt3-1.3b", "--gpus", "16", "--global-batch", "512", "--search", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)[0]["fits"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3"], "mtnlg-plan: error: num_heads 128 is not divisible by tensor_parallel 3"),
        # the trainer's message (parallel/config.py): the planner checks a layout as `mtnlg fit` does
        (["--pp", "106"], "mtnlg-plan: error: num_layers 105 is fewer than pipeline_parallel 106 stages"),
        (["--gpu", "v100"], "mtnlg-plan: error: unknown gpu 'v100'; known GPUs: a100, a100-40g, a100-80g, h100"),
        (["--layers", "4"], "mtnlg-plan: error: a model by dimensions needs --hidden, --heads, --seq"),
        (["--model", "gpt9"], "mtnlg-plan: error: unknown model preset 'gpt9'"),
        (["--write-config", "/nonexistent/dir/x.yaml"], "mtnlg-plan: error: --write-config: folder /nonexistent/dir"),
    ],
)
def test_plan_cli_bad_input_is_one_line_with_exit_status_2(args, message):
    out = run_plan(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(message) and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.distributed
def test_write_config_output_trains_through_mtnlg_fit(tmp_path):
    """The tiny model on 2 ranks: the planner writes the tp2 layout as a strategy YAML, `mtnlg fit` trains it."""
    path = tmp_path / "best.yaml"
    out = run_plan(
        *("--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "8", "--micro-batch", "2"),
        *("--tp", "2", "--pp", "1", "--dp", "1", "--zero-stage", "0", "--recompute", "none"),
        *("--write-config", str(path)),
    )
    assert out.returncode == 0, out.stderr
    written = yaml.safe_load(path.read_text())
    assert written["class_path"] == "mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy"
    assert written["init_args"]["tensor_parallel"] == 2 and written["init_args"]["pipeline_parallel"] == 1
    assert "--model.micro_batch_size 2 --model.global_batch_size 8" in out.stdout
    fit = run_cli(
        *("fit", "--config", "configs/tiny.yaml", "--trainer.strategy", str(path), "--trainer.devices", "2"),
        *("--trainer.max_steps", "3", "--model.micro_batch_size", "2", "--model.global_batch_size", "8"),
        *("--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)),
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "layout: world 2 = pp 1 x dp 1 x tp 2" in fit.stdout + fit.stderr
    assert list(tmp_path.rglob("metrics.csv"))
