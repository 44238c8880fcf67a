"""Fine-tuning data: chat templates rendered to transformers' ids, masks on the assistant's tokens, packed rows.

The tokenizer directories are built here (a small byte-level BPE trained on the spot, the chat special tokens
added, tokenizer_config.json holding the real Llama 3, Qwen 2.5 and Mistral template strings), and transformers
reads each of them as a user's model directory: `AutoTokenizer.from_pretrained(dir).apply_chat_template(...)` is
the reference for the ids and, where a template has `{% generation %}` tags, for the assistant mask.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from mtnlg_lightning.data.chat_records import read_conversations, to_messages
from mtnlg_lightning.data.chat_template import NAMED_TEMPLATES, ChatTokenizer
from mtnlg_lightning.data.datamodule import StepBatches
from mtnlg_lightning.data.finetune import FineTuneDataModule, encode_split, to_example
from mtnlg_lightning.data.packing import (
    PADDING_DOCUMENT,
    Example,
    Rows,
    ShuffledRows,
    assemble_row,
    best_fit_decreasing,
    rows_batch,
)
from mtnlg_lightning.demo.synthetic.instructions import answer_of, instruction_examples, write_instructions
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.train.module import MTNLGModule

transformers = pytest.importorskip("transformers")

# Meta-Llama-3-8B-Instruct's template, as its tokenizer_config.json ships it.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct's ChatML template (tools and all).
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# The same template with the assistant's turn in {% generation %} tags (as TRL's *_training.jinja templates do).
QWEN25_TAGGED = QWEN25.replace(
    """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}""",  # noqa: E501
    """    {%- if message.role == "assistant" and not message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- elif (message.role == "user") or (message.role == "system" and not loop.first) %}""",  # noqa: E501
)

# Mistral-7B-Instruct-v0.1's template: no generation prompt, no system turn, the end of turn is eos.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

SPECIALS = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
]
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "The answer is 19."},
    {"role": "user", "content": "And the lazy dog, où est-il?  "},
    {"role": "assistant", "content": " It sleeps\nover there. "},
]
ALTERNATING = [m for m in CHAT if m["role"] != "system"]


def texts():
    for conversation in [CHAT] + [r["messages"] for r in instruction_examples(60)]:
        yield " ".join(m["content"] for m in conversation)


def tokenizer_dir(path: Path, family: str, template: str) -> Path:
    """A model directory as users bring one: tokenizer.json (a 400-token BPE with the family's pre-tokenizer and
    its special tokens; Llama's adds <|begin_of_text|> when asked to) and tokenizer_config.json with `template`."""
    tokenizer = Tokenizer(BPE())
    if family == "qwen":  # Qwen 2's pipeline (transformers' Qwen2Tokenizer builds the same)
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts()), trainer=trainer)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    configs = {
        "llama": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
        },
        "qwen": {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
        },
        "mistral": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<|endoftext|>",
        },
    }
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({**configs[family], "chat_template": template}))
    return path


def reference(directory: Path, messages: list[dict]) -> dict:
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    tagged = "{% generation %}" in (hf.chat_template or "")
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=tagged)
    return {"ids": list(out["input_ids"]), "mask": list(out["assistant_masks"]) if tagged else None}


TEMPLATES = {
    "llama3": ("llama", LLAMA3, CHAT),
    "qwen2.5": ("qwen", QWEN25, CHAT),
    "mistral": ("mistral", MISTRAL, ALTERNATING),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_ids_equal_apply_chat_template(tmp_path, name):
    family, template, messages = TEMPLATES[name]
    directory = tokenizer_dir(tmp_path / name, family, template)
    ours = ChatTokenizer(directory).encode(messages)
    assert ours.ids == reference(directory, messages)["ids"]
    assert len(ours.ids) > 30 and 0 < sum(ours.trained) < len(ours.ids)


@pytest.mark.parametrize(
    "family, plain, tagged",
    [("llama", LLAMA3, NAMED_TEMPLATES["llama3"]), ("qwen", QWEN25, QWEN25_TAGGED)],
    ids=["llama3", "qwen2.5"],
)
def test_masks_equal_return_assistant_tokens_mask(tmp_path, family, plain, tagged):
    """With tags the mask is transformers' `assistant_masks`; the shipped template without tags, masked by rendering
    prefixes, gives the same ids and the same mask."""
    with_tags = tokenizer_dir(tmp_path / "tagged", family, tagged)
    expected = reference(with_tags, CHAT)
    from_tags = ChatTokenizer(with_tags).encode(CHAT)
    from_prefixes = ChatTokenizer(tokenizer_dir(tmp_path / "plain", family, plain)).encode(CHAT)
    assert from_tags.ids == from_prefixes.ids == expected["ids"]
    assert [int(t) for t in from_tags.trained] == expected["mask"]
    assert [int(t) for t in from_prefixes.trained] == expected["mask"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_end_of_turn_token_is_a_trained_label_and_prompts_are_not(tmp_path, name):
    family, template, messages = TEMPLATES[name]
    chat = ChatTokenizer(tokenizer_dir(tmp_path, family, template))
    end_of_turn = {"llama": "<|eot_id|>", "qwen": "<|im_end|>", "mistral": "</s>"}[family]
    example = to_example(chat.encode(messages), seq_len=1024)
    labels = example.labels[example.labels != IGNORE_INDEX].tolist()
    eot = chat.tokenizer.token_to_id(end_of_turn)
    assert labels.count(eot) == 2  # both assistant turns end with it
    trained_text = chat.tokenizer.decode(labels, skip_special_tokens=False)
    assert "19" in trained_text and "sleeps" in trained_text
    assert "12 + 7" not in trained_text and "assistant" not in trained_text and "careful" not in trained_text


def test_train_on_all_trains_every_next_token(tmp_path):
    chat = ChatTokenizer(tokenizer_dir(tmp_path, "llama", LLAMA3))
    encoded = chat.encode(CHAT, train_on="all")
    example = to_example(encoded, 1024)
    assert example.labels[:-1].tolist() == encoded.ids[1:] and example.labels[-1] == IGNORE_INDEX


def test_named_and_custom_templates_replace_the_directorys(tmp_path):
    directory = tokenizer_dir(tmp_path / "d", "llama", QWEN25)
    named = ChatTokenizer(directory, "chatml").render(CHAT[1:3])
    assert named == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\nThe answer is 19.<|im_end|>\n"
    custom = ChatTokenizer(directory, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert custom.render(CHAT[1:2]) == "user: What is 12 + 7?\n"
    (directory / "chat_template.jinja").write_text(LLAMA3)  # transformers prefers the .jinja file
    from_file = ChatTokenizer(directory)
    assert from_file.render(CHAT[1:2]).startswith("<|begin_of_text|><|start_header_id|>user")
    assert from_file.encode(CHAT).ids == reference(directory, CHAT)["ids"]
    with pytest.raises(MTNLGError, match="no template name"):
        ChatTokenizer(directory, "vicuna")


def test_a_truncated_example_is_dropped_and_counted(tmp_path):
    directory = tokenizer_dir(tmp_path / "d", "llama", LLAMA3)
    chat = ChatTokenizer(directory)
    long_prompt = [{"role": "user", "content": "the lazy dog " * 40}, {"role": "assistant", "content": "19"}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is 19."}]
    no_answer = [{"role": "user", "content": "hi"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (long_prompt, short, no_answer, short)))
    split = encode_split(str(data), chat, seq_len=32, train_on="assistant")
    assert split.read == 4 and len(split.examples) == 2
    assert dict(split.dropped) == {"truncated": 1, "untrained": 1}
    assert (
        "dropped 2 of 4 examples (1 their assistant part lies beyond seq_len 32; 1 no assistant turn)"
        in split.summary("train", 32)
    )
    # Cut inside the answer: kept, with the answer's first tokens.
    cut = to_example(chat.encode(short), seq_len=len(chat.encode(short).ids) - 2)
    assert cut is not None and (cut.labels != IGNORE_INDEX).sum() >= 1


def test_record_forms_become_conversations():
    where = "f.jsonl:1"
    assert to_messages({"instruction": "Add", "input": "1 2", "output": "3"}, where) == [
        {"role": "user", "content": "Add\n\n1 2"},
        {"role": "assistant", "content": "3"},
    ]
    assert to_messages({"prompt": "Q", "completion": "A"}, where)[1] == {"role": "assistant", "content": "A"}
    sharegpt = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    assert to_messages(sharegpt, where) == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    turns = [{"role": "user", "content": "Q"}]
    assert to_messages({"prompt": turns, "completion": [{"role": "assistant", "content": "A"}]}, where)[0] == turns[0]


def test_a_file_in_no_known_form_names_the_fields_seen(tmp_path):
    data = tmp_path / "bad.jsonl.gz"
    with gzip.open(data, "wt") as handle:
        handle.write(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"question": "Q", "answer": "A"}) + "\n")
    with pytest.raises(MTNLGError, match=r"bad.jsonl.gz:2: a record in no known form \(fields: answer, question\)"):
        list(read_conversations(str(data)))


def test_a_template_that_fails_names_the_record(tmp_path):
    chat = ChatTokenizer(tokenizer_dir(tmp_path / "d", "mistral", MISTRAL))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": ALTERNATING}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(MTNLGError, match=r"chat.jsonl:2: the chat template fails on this record: Conversation roles"):
        encode_split(str(data), chat, 256, "assistant")


def test_parquet_records_are_read(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"messages": [CHAT, ALTERNATING]})
    pq.write_table(table, tmp_path / "chat.parquet")
    conversations = list(read_conversations(str(tmp_path)))
    assert [c.messages for c in conversations] == [CHAT, ALTERNATING]
    assert conversations[1].where.endswith("chat.parquet:row 2")


# ------------------------------------------------------------------ packing


def example(length: int, first: int = 1) -> Example:
    ids = np.arange(first, first + length, dtype=np.int64)
    labels = np.append(ids[1:], IGNORE_INDEX)
    return Example(ids, labels)


def test_best_fit_decreasing_fills_rows():
    lengths = [7, 5, 4, 3, 3, 2, 2, 1, 1]  # 28 tokens: 4 rows of 8 at best
    bins = best_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4
    assert bins[0] == [0, 7]  # 7, then the 1 that fills it exactly
    with pytest.raises(ValueError):
        best_fit_decreasing([9], 8)


def test_a_packed_row_restarts_positions_and_no_label_crosses_a_document():
    docs = [example(4, first=10), example(3, first=20), example(2, first=30)]
    row = assemble_row(docs, seq_len=12, pad_id=0)
    assert row["document_ids"].tolist() == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        PADDING_DOCUMENT,
        PADDING_DOCUMENT,
        PADDING_DOCUMENT,
    ]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2]
    assert row["input_ids"].tolist()[:9] == [10, 11, 12, 13, 20, 21, 22, 30, 31]
    labels = row["labels"].tolist()
    assert labels == [11, 12, 13, IGNORE_INDEX, 21, 22, IGNORE_INDEX, 31, IGNORE_INDEX] + [IGNORE_INDEX] * 3
    # Every counted label is the next input of the same document: none reaches into the next one.
    for j, label in enumerate(labels):
        if label != IGNORE_INDEX:
            assert row["document_ids"][j + 1] == row["document_ids"][j] and row["input_ids"][j + 1] == label


def test_unpacked_rows_hold_one_padded_example_each():
    docs = [example(5), example(3)]
    rows = Rows.one_per_row(docs, seq_len=8, pad_id=99)
    assert len(rows) == 2
    assert rows[1]["input_ids"].tolist() == [1, 2, 3, 99, 99, 99, 99, 99]
    assert rows[1]["labels"].tolist()[3:] == [IGNORE_INDEX] * 5
    assert rows[1]["document_ids"].tolist() == [0, 0, 0] + [PADDING_DOCUMENT] * 5
    packed = Rows.packed(docs, seq_len=8, pad_id=99)
    assert len(packed) == 1 and packed.token_share() == 1.0 and rows.token_share() == 0.5


def test_row_order_is_deterministic_per_seed_and_each_epoch_sees_every_row():
    rows = Rows.one_per_row([example(2, first=i * 10) for i in range(10)], seq_len=4, pad_id=0)
    first = [ShuffledRows(rows, 30, seed=3)[i]["input_ids"][0] for i in range(30)]
    again = [ShuffledRows(rows, 30, seed=3)[i]["input_ids"][0] for i in range(30)]
    other = [ShuffledRows(rows, 30, seed=4)[i]["input_ids"][0] for i in range(30)]
    assert first == again and first != other
    for epoch in range(3):
        assert sorted(first[epoch * 10 : (epoch + 1) * 10]) == [i * 10 for i in range(10)]
    assert first[:10] != first[10:20]


def test_step_batches_of_rows_split_by_data_parallel_rank():
    rows = ShuffledRows(Rows.packed([example(n) for n in (5, 3, 6, 2, 7, 1, 4, 4)], 8, 0), 12, seed=0)
    whole = list(StepBatches(rows, lambda _: 4, 0, 12, 0, 1, rows_batch))
    shards = [list(StepBatches(rows, lambda _: 4, 0, 12, rank, 2, rows_batch)) for rank in range(2)]
    assert len(whole) == 3
    for step, batch in enumerate(whole):
        assert set(batch) == {
            "input_ids",
            "labels",
            "position_ids",
            "document_ids",
            "row_lengths",
            "consumed_samples",
            "global_batch_size",
        }
        assert batch["document_ids"].shape == (4, 8) and batch["document_ids"].dtype == torch.int64
        assert int(batch["consumed_samples"]) == 4 * step and int(batch["global_batch_size"]) == 4
        for field in ("input_ids", "labels", "position_ids", "document_ids", "row_lengths"):
            assert torch.equal(torch.cat([shards[0][step][field], shards[1][step][field]]), batch[field])


# ------------------------------------------------------------------ the data module


def test_the_data_module_packs_the_synthetic_set_into_rows(tmp_path):
    directory = tokenizer_dir(tmp_path / "model", "qwen", QWEN25)
    train = write_instructions(tmp_path / "train.jsonl", count=200)
    valid = write_instructions(tmp_path / "valid.jsonl", count=20, seed=1)
    data = FineTuneDataModule(train=str(train), valid=str(valid), tokenizer=str(directory))
    overrides = {"seq_len": 256, "max_position_embeddings": 256, "vocab_size": 512}
    module = MTNLGModule(preset="tiny", model_overrides=overrides, global_batch_size=4, micro_batch_size=2)
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=5, strategy=None, global_rank=0, world_size=1)
    data.setup("fit")
    assert len(data.splits["train"]) == 20  # 5 steps of 4 rows
    rows = data.splits["train"].rows
    tokens = sum(len(e) for e in rows.examples)  # 45 to 53 tokens an example: 4 or 5 to a row of 256
    assert len(rows) <= -(-tokens // 256) + 3 and rows.token_share() > 0.9
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 256) and batch["document_ids"].max() >= 3
    assert (batch["labels"] != IGNORE_INDEX).sum() > 0
    assert len(data.splits["valid"]) % 4 == 0 and len(data.splits["valid"]) >= 4
    assert data.tokenizer_file == str(directory / "tokenizer.json")
    unpacked = FineTuneDataModule(train=str(train), tokenizer=str(directory), pack=False)
    unpacked.trainer = data.trainer
    unpacked.setup("fit")
    assert len(unpacked.splits["train"].rows) == 200


def test_the_synthetic_instruction_set_is_deterministic_and_answerable():
    records = instruction_examples(50, seed=7)
    assert records == instruction_examples(50, seed=7) and records != instruction_examples(50, seed=8)
    for record in records:
        question, answer = record["messages"][1]["content"], record["messages"][2]["content"]
        assert answer_of(question) == answer
    assert answer_of("Tell me a story.") is None


def tiny_chat_run(tmp_path: Path, train: Path, seq_len: int, pack: bool = True, **settings):
    """(module, data) of the tiny model (a 512-token vocabulary, rows of `seq_len`, none of a run's services) on the
    Llama-templated records `train`; `settings`: the module's (batch sizes, learning rate, ...)."""
    directory = tokenizer_dir(tmp_path / "model", "llama", LLAMA3)
    data = FineTuneDataModule(train=str(train), tokenizer=str(directory), pack=pack)
    overrides = {"seq_len": seq_len, "max_position_embeddings": seq_len, "vocab_size": 512}
    module = MTNLGModule(
        preset="tiny",
        model_overrides=overrides,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
        **settings,
    )
    return module, data


def test_a_fit_trains_on_the_packed_rows_and_the_loss_falls(tmp_path):
    """The module consumes the rows as they come (labels, positions; the document ids travel with them) and the
    assistant-only loss falls over a few steps on the synthetic set."""
    import lightning as L

    train = write_instructions(tmp_path / "train.jsonl", count=64)
    settings = {"global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3, "warmup_tokens": 0}
    module, data = tiny_chat_run(tmp_path, train, 128, **settings)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    trainer = L.Trainer(
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[Record()],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
