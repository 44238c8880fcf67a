"""A fine-tuned model keeps its chat template and speaks it: the checkpoint of a fine-tuning run carries the template
(listed and hashed in its manifest), `mtnlg-export-hf` writes it with the tokenizer so that transformers'
`apply_chat_template` gives our ids and its `generate` stops where ours does, `mtnlg-generate --chat` prints the
model's greedy answer to exactly those ids and stops at the end of the turn (in one process and in a layout), and
`mtnlg-eval` scores the LoRA checkpoint of a run on the exported model.

The model is trained here: a random Llama directory with a Llama 3 chat tokenizer (test_finetune_data's), fine-tuned
on the synthetic instruction set (every weight, 16 steps: enough to answer in a token or two and end the turn), its
export fine-tuned again with LoRA (3 steps).
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hf_models import TEST_BLOCK, random_family_dir
from lightning.pytorch.callbacks import ModelCheckpoint
from test_finetune_data import LLAMA3, tokenizer_dir

from mtnlg_lightning.checkpoint import read_model_state
from mtnlg_lightning.checkpoint.format import CheckpointError
from mtnlg_lightning.checkpoint.sharded import chat_files_of
from mtnlg_lightning.data.chat_template import NAMED_TEMPLATES, ChatTokenizer, directory_template_files
from mtnlg_lightning.data.finetune import FineTuneDataModule
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.synthetic.instructions import instruction_examples
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.evaluation.tasks import rolling_loglik
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.interop.hf import generation_config
from mtnlg_lightning.train.module import MTNLGModule
from testing.lightning_run import quiet_trainer

transformers = pytest.importorskip("transformers")

SFT_STEPS, LORA_STEPS = 16, 3
QUESTIONS = [r["messages"][0]["content"] for r in instruction_examples(5, seed=5, system=False)]
GREEDY = ["--temperature", "0", "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "12"]


def chat_model_dir(root: Path) -> Path:
    """A random Llama directory (vocabulary 400) with a Llama 3 chat tokenizer: tokenizer.json with the chat special
    tokens, tokenizer_config.json with Meta's template and <|eot_id|> as eos."""
    tokens = tokenizer_dir(root / "tokenizer", "llama", LLAMA3)
    eot = Tokenizer(tokens).encode("<|eot_id|>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TEST_BLOCK, "vocab_size": 400}, eos_token_id=eot[0])
    out = root / "llama-chat"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokens / name, out / name)
    return out


def fine_tune(init_from: Path, train: Path, directory: Path, steps: int, lr: float, lora: dict | None = None):
    """`steps` steps of fine-tuning on `train` (the data's template: the directory's own), a checkpoint at the end."""
    L.seed_everything(0, verbose=False)
    module = MTNLGModule(
        preset="tiny",
        lr=lr,
        min_lr=lr / 10,
        warmup_tokens=0,
        decay_tokens=10**9,
        init_from=str(init_from),
        lora=lora,
        model_overrides={"seq_len": 64},
        global_batch_size=4,
        micro_batch_size=4,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
    )
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=steps, filename="{step}")
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=True, callbacks=[checkpoint]
    )
    trainer.fit(module, FineTuneDataModule(train=str(train)))
    return directory / f"step={steps}.ckpt", trainer.lightning_module.model.eval()


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_run")
    base = chat_model_dir(root)
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in instruction_examples(200, system=False)))
    sft, _ = fine_tune(base, train, root / "sft", SFT_STEPS, lr=1e-2)
    exported = root / "sft-hf"
    assert export_main([str(sft), str(exported)]) == 0
    lora, lora_model = fine_tune(exported, train, root / "lora", LORA_STEPS, lr=1e-2, lora={"rank": 4, "alpha": 8})
    return SimpleNamespace(root=root, base=base, sft=sft, exported=exported, lora=lora, lora_model=lora_model)


def chat(checkpoint, question: str, *flags: str, capsys) -> tuple[str, str]:
    """(stdout, stderr) of `mtnlg-generate --chat` of one question, greedy."""
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(checkpoint), "--chat", "--prompt", question, *GREEDY, *flags]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def transformers_answer(directory: Path, messages: list[dict]) -> tuple[list[int], list[int], bool]:
    """transformers on an exported directory: (apply_chat_template's ids with the generation prompt, the greedy
    answer's tokens without the end token, whether generation stopped at an eos id of generation_config.json)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        made = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    stopped = bool(made) and made[-1] in eos
    return ids, made[:-1] if stopped else made, stopped


# ------------------------------------------------------------------------------------------------ the checkpoint
def test_a_fine_tuning_checkpoint_carries_its_chat_template_listed_and_hashed(chat_run, tmp_path):
    manifest = json.loads((chat_run.sft / "manifest.json").read_text())
    assert {"tokenizer.json", "chat_template.jinja", "tokenizer_config.json"} <= set(manifest["files"])
    assert (chat_run.sft / "chat_template.jinja").read_text() == LLAMA3
    specials = json.loads((chat_run.sft / "tokenizer_config.json").read_text())
    assert (specials["bos_token"], specials["eos_token"]) == ("<|begin_of_text|>", "<|eot_id|>")
    state = read_model_state(chat_run.sft)
    assert state.chat == chat_run.sft
    ours = ChatTokenizer(state.chat, tokenizer_file=state.tokenizer)
    assert (
        ours.encode([{"role": "user", "content": "Hi"}]).ids
        == ChatTokenizer(chat_run.base).encode([{"role": "user", "content": "Hi"}]).ids
    )

    altered = shutil.copytree(chat_run.sft, tmp_path / "altered.ckpt")
    (altered / "chat_template.jinja").write_text(NAMED_TEMPLATES["chatml"])
    with pytest.raises(CheckpointError, match="chat_template.jinja has .* bytes|does not match its checksum"):
        read_model_state(altered)
    manifest["files"].pop("chat_template.jinja")
    (altered / "manifest.json").write_text(json.dumps(manifest))
    assert read_model_state(altered).chat is None  # present but unlisted: not used


def test_a_run_whose_data_names_no_template_carries_the_template_of_the_directory_it_started_from(chat_run, tmp_path):
    """Pretraining data (no template) on a run from a chat model directory, or from a checkpoint that carries one:
    the checkpoint carries that template; from a directory without one, none."""

    def trainer(init_from):
        module = SimpleNamespace(hparams={"init_from": str(init_from) if init_from else None})
        return SimpleNamespace(datamodule=SimpleNamespace(tokenizer_file=None), lightning_module=module)

    expected = directory_template_files(chat_run.base)
    assert expected["chat_template.jinja"].decode() == LLAMA3
    assert chat_files_of(trainer(chat_run.base)) == expected
    assert chat_files_of(trainer(chat_run.sft)) == expected  # a checkpoint carrying it
    assert chat_files_of(trainer(random_family_dir(tmp_path, "llama"))) == {}
    assert chat_files_of(trainer(None)) == {}


# ------------------------------------------------------------------------------------------------ export
def test_the_export_renders_apply_chat_template_as_ours_and_names_the_end_of_turn(chat_run):
    hf = transformers.AutoTokenizer.from_pretrained(chat_run.exported)
    ours = ChatTokenizer(read_model_state(chat_run.sft).chat)
    conversation = [
        {"role": "system", "content": "Answer with the result only."},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "55"},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    for messages in (conversation[1:2], conversation):
        theirs = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert list(theirs) == ours.prompt_ids(messages)
    config = json.loads((chat_run.exported / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|eot_id|>")
    generation = json.loads((chat_run.exported / "generation_config.json").read_text())
    eot, eod = ours.tokenizer.token_to_id("<|eot_id|>"), ours.tokenizer.token_to_id("<|endoftext|>")
    assert generation["eos_token_id"] == [eot, eod] and generation["bos_token_id"] == hf.bos_token_id


def test_an_adapter_export_carries_the_tokenizer_and_chat_template(chat_run, tmp_path):
    import peft

    out = tmp_path / "adapter"
    assert export_main([str(chat_run.lora), str(out), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert list(ids) == ChatTokenizer(chat_run.base).prompt_ids(messages)
    base = transformers.AutoModelForCausalLM.from_pretrained(chat_run.exported, dtype=torch.float32)
    peft.PeftModel.from_pretrained(base, out)  # the tokenizer files beside the adapter do not disturb peft


# ------------------------------------------------------------------------------------------------ mtnlg-generate --chat
@pytest.mark.parametrize("system", [None, "Answer with the result only."], ids=["user", "system+user"])
def test_chat_prints_the_greedy_answer_to_apply_chat_templates_ids_and_stops_at_the_end_of_turn(
    chat_run, system, capsys
):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ""}]
    stopped_early = 0
    for question in QUESTIONS:
        messages[-1]["content"] = question
        ids, answer, stopped = transformers_answer(chat_run.exported, messages)
        assert ids == ChatTokenizer(chat_run.base).prompt_ids(messages)  # the base's own template and tokenizer
        flags = ["--system", system] if system else []
        out, err = chat(chat_run.sft, question, *flags, capsys=capsys)
        assert out == Tokenizer(chat_run.base).decode(answer) + "\n"
        assert f"mtnlg-generate: {len(answer)} tokens" in err  # the end token is not part of the answer
        stopped_early += stopped and len(answer) < 12
    if system is None:  # as it was trained: every answer ends at <|eot_id|>, none at --max-new-tokens
        assert stopped_early == len(QUESTIONS)


def test_chat_without_a_template_is_one_line_naming_chat_template(tmp_path, capsys):
    plain = random_family_dir(tmp_path, "llama")  # no chat template
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(plain), "--chat", "--prompt", "Hi", *GREEDY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no chat template" in err and "--chat-template" in err
    assert generate_main(["--checkpoint", str(plain), "--system", "Be brief.", "--prompt", "Hi"]) == 2
    assert "go with --chat" in capsys.readouterr().err


def test_an_end_marker_of_several_tokens_ends_the_answer_by_its_text(tmp_path, capsys):
    """ChatML on a tokenizer without its special tokens: <|im_end|> is several tokens, so its text ends the turn.
    Shown with a template whose end marker is a piece of the model's own greedy answer: the answer stops at the token
    that completes it and prints what came before."""
    plain = random_family_dir(tmp_path, "llama")  # the demo tokenizer: no <|im_start|>, <|im_end|>
    chatml = ChatTokenizer(plain, "chatml", option="--chat-template")
    assert chatml.end_of_turn().texts == ("<|im_end|>",)
    generation = generation_config(transformers, Tokenizer(plain), chatml)  # what an export of it writes
    generation.save_pretrained(tmp_path / "export")
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "export").stop_strings == ["<|im_end|>"]
    free, _ = chat(plain, "Return the", "--chat-template", "chatml", capsys=capsys)
    model, _ = load_model(plain)
    prompt = chatml.prompt_ids([{"role": "user", "content": "Return the"}])
    tokens = generate(model, prompt, 12, temperature=0, eos_id=Tokenizer(plain).eod_id).tokens[0]
    assert chatml.decode(tokens) + "\n" == free and len(tokens) == 12  # the random model never ends its turn
    marker, end = None, None
    for start in range(2, len(tokens) - 3):
        for stop in (start + 2, start + 3):
            piece = chatml.decode(tokens[start:stop]).strip()
            if re.fullmatch(r"[A-Za-z0-9.,:;()_-]{3,}", piece) and piece not in chatml.decode(tokens[: stop - 1]):
                if len(chatml.tokenizer.encode(piece).ids) > 1 and piece in chatml.decode(tokens[:stop]):
                    marker, end = piece, stop
                    break
        if marker:
            break
    assert marker is not None, f"no marker of several tokens in {free!r}"
    assistant_end = "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    template = NAMED_TEMPLATES["chatml"].replace(assistant_end, assistant_end.replace("<|im_end|>", marker))
    out, err = chat(plain, "Return the", "--chat-template", template, capsys=capsys)
    assert out == free[: free.index(marker)] + "\n"
    assert f"mtnlg-generate: {end} tokens" in err


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_chat_prints_the_same_answers_in_a_layout(chat_run, tmp_path, capfd, monkeypatch):
    """tp2 x pp2 (4 ranks, one prompt: the answer streamed) and tp2 x dp2 (4 ranks, two prompts dealt over the
    replicas) print what one process prints (the LoRA checkpoint: its base merged in every rank's slices)."""
    tp2_pp2 = tmp_path / "tp2_pp2.yaml"
    tp2_pp2.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\n"
        "init_args: {tensor_parallel: 2, pipeline_parallel: 2}\n"
    )
    common = ["--checkpoint", str(chat_run.lora), "--chat", *GREEDY]
    runs = {
        "one prompt": ([QUESTIONS[0]], ["--strategy", str(tp2_pp2), "--devices", "4"]),
        "two prompts": (QUESTIONS[1:3], ["--strategy", "strategy/tp2", "--devices", "4"]),
    }
    for name, (questions, layout) in runs.items():
        printed = []
        for where in ([], layout):
            monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(questions) + "\n"))
            assert generate_main([*common, "--prompt", "-" if len(questions) > 1 else questions[0], *where]) == 0
            printed.append(capfd.readouterr().out)
        assert printed[1] == printed[0], name
    assert "--- prompt 2 sample 1 ---" in printed[0]


# ------------------------------------------------------------------------------------------------ mtnlg-eval
def test_eval_scores_the_lora_checkpoint_as_its_trained_model(chat_run, tmp_path):
    """Perplexity of the LoRA checkpoint (its base: the exported fine-tuned model, the adapters merged) equals the
    trained model's own (adapters unmerged, in memory), and differs from the base's."""
    text = tmp_path / "chats.txt"
    pairs = [r["messages"] for r in instruction_examples(5, seed=5, system=False)]
    text.write_text(" ".join(f"{question['content']} {answer['content']}." for question, answer in pairs))
    scores = {}
    for name, source in {"lora": chat_run.lora, "base": chat_run.exported}.items():
        out = tmp_path / f"{name}.json"
        argv = ["--checkpoint", str(source), "--task", "perplexity", "--data", str(text), "--dtype", "fp32"]
        assert eval_main([*argv, "--device", "cpu", "--no-progress", "--output", str(out)]) == 0
        scores[name] = json.loads(out.read_text())["results"]["perplexity"]["-"]
    tokenizer = Tokenizer(chat_run.base)
    loglik, tokens = rolling_loglik(Scorer(chat_run.lora_model), [tokenizer.encode(text.read_text())], tokenizer.eod_id)
    assert scores["lora"]["tokens"] == tokens
    assert scores["lora"]["perplexity"] == pytest.approx(float(torch.tensor(-loglik / tokens).exp()), rel=1e-5)
    assert scores["lora"]["perplexity"] != pytest.approx(scores["base"]["perplexity"], rel=1e-4)
