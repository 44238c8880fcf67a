"""GRPO's inputs: prompt records in TRL's two forms become the ids the model reads before its completions, their other
fields travel as columns aligned with the prompts, prompts beyond the budget are dropped and counted, and bad records
are one line; reward functions load from a shipped name, a module, a file or a mapping with bound arguments, score a
batch as TRL's GRPOTrainer does (None is NaN, TRL's own functions work unchanged) and fail in one line naming the
function and the prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, processors

from mtnlg_lightning.data.chat_template import NAMED_TEMPLATES, ChatTokenizer, template_files
from mtnlg_lightning.data.prompts import PromptDataModule, prompts_batch
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.rewards import RewardFunctions, accuracy, format, length, load_rewards, score
from mtnlg_lightning.rewards.builtin import DEFAULT_LENGTH_TARGET
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule
from mtnlg_lightning.train.objectives import LanguageModelling
from mtnlg_lightning.train.objectives.objective import Objective

EOT = "<|endoftext|>"  # the demo tokenizer's one special token (id 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The demo tokenizer with a post-processor that puts its end-of-text token first (as Llama's tokenizer.json
    adds its bos), the ChatML template and the named special tokens in transformers' own files."""
    directory = tmp_path_factory.mktemp("prompt_model")
    tokenizer = Tokenizer.from_file(build_demo_data(progress=False)[1])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A $B", special_tokens=[(EOT, tokenizer.token_to_id(EOT))]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, content in template_files(NAMED_TEMPLATES["chatml"], {"bos_token": EOT, "eos_token": EOT}).items():
        (directory / name).write_bytes(content)
    return directory


class GRPOStub(Objective):
    """What the data module asks of the GRPO objective: that it trains on prompts, and its prompt budget."""

    name = "grpo"
    data_kind = "prompts"

    def __init__(self, max_completion_length: int):
        self.max_completion_length = max_completion_length

    def max_prompt_tokens(self, seq_len: int) -> int:
        return seq_len - self.max_completion_length


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def prompt_data(model_dir: Path, train: Path, seq_len: int = 128, completion: int = 32, objective=None, **options):
    module = SimpleNamespace(
        config=SimpleNamespace(seq_len=seq_len, padded_vocab_size=lambda: 4096),
        batch_schedule=BatchSizeSchedule(4),
        objective=objective or GRPOStub(completion),
        hparams={},
        position=SimpleNamespace(consumed_samples=0),
        micro_batch_size=2,
    )
    data = PromptDataModule(train=str(train), tokenizer=str(model_dir), **options)
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=2, strategy=None, global_rank=0, world_size=1)
    data.setup("fit")
    return data


def question(n: int) -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"What is {n} + {n}?"}]


# ------------------------------------------------------------------------------------------------ prompt data
def test_prompts_in_both_forms_with_their_columns_make_step_batches(model_dir, tmp_path):
    """A string prompt is its text's ids (the tokenizer's special tokens added); a conversation is the template's
    prompt with the generation prompt; every other field is a column aligned with the prompts."""
    records = [
        {"prompt": "Twice 3 is", "answer": 6},
        {"prompt": question(4), "answer": "8", "tests": ["assert f(4) == 8"]},
        {"prompt": "Say hi.", "completion": "hi", "completion_ids": [1]},  # the generation's names: no columns
        {"prompt": question(5), "answer": 10},
    ]
    data = prompt_data(model_dir, write_records(tmp_path / "p.jsonl", records))
    chat = ChatTokenizer(model_dir)
    rows = data.splits["train"]
    assert len(rows) == 8  # 2 steps of 4 prompts
    samples = {json.dumps(s.prompt): s for s in rows.rows}
    assert samples['"Twice 3 is"'].ids == chat.tokenizer.encode("Twice 3 is").ids
    assert samples['"Twice 3 is"'].ids[0] == chat.tokenizer.token_to_id(EOT)
    assert samples[json.dumps(question(4))].ids == chat.prompt_ids(question(4))
    assert chat.decode(samples[json.dumps(question(4))].ids).endswith("<|im_start|>assistant\n")

    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"prompt_ids", "prompt_tokens", "prompts", "columns", "consumed_samples", "global_batch_size"}
    assert batch["prompt_tokens"].dtype == torch.long and batch["prompt_tokens"].tolist() == [
        len(ids) for ids in batch["prompt_ids"]
    ]
    assert set(batch["columns"]) == {"answer", "tests"}
    for prompt, ids, answer, tests in zip(
        batch["prompts"], batch["prompt_ids"], batch["columns"]["answer"], batch["columns"]["tests"], strict=True
    ):
        sample = samples[json.dumps(prompt)]
        assert ids == sample.ids and all(isinstance(i, int) for i in ids)
        record = records[[json.dumps(r["prompt"]) for r in records].index(json.dumps(prompt))]
        assert answer == record.get("answer") and tests == record.get("tests")  # None where the record lacks it


def test_string_prompts_tokenize_as_trls_grpo_trainer_and_conversations_as_apply_chat_template(model_dir, tmp_path):
    """TRL 1.16 tokenizes standard prompts with `processing_class(text=prompts)` (special tokens added) and
    conversational ones with `apply_chat_template(..., add_generation_prompt=True, tokenize=True)`."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    records = [{"prompt": "Twice 3 is"}, {"prompt": question(7)}]
    data = prompt_data(model_dir, write_records(tmp_path / "p.jsonl", records))
    ours = {json.dumps(s.prompt): s.ids for s in data.splits["train"].rows}
    assert ours['"Twice 3 is"'] == tokenizer(text=["Twice 3 is"])["input_ids"][0]
    theirs = tokenizer.apply_chat_template([question(7)], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours[json.dumps(question(7))] == list(theirs["input_ids"][0])


def test_long_prompts_are_dropped_and_counted_and_no_prompt_left_is_one_line(model_dir, tmp_path, capsys):
    records = [{"prompt": f"Add {n} and {n}.", "answer": 2 * n} for n in range(6)]
    records[1] = {"prompt": "word " * 48, "answer": 0}  # over 48 tokens with the end-of-text token first
    records[4] = {"prompt": [{"role": "user", "content": "word " * 30}], "answer": 0}
    data = prompt_data(model_dir, write_records(tmp_path / "p.jsonl", records), seq_len=64, completion=16)
    assert data.dropped["train"] == {"long": 2} and len(data.splits["train"].rows) == 4
    out = capsys.readouterr().out
    assert "prompt data [train]: dropped 2 of 6 prompts (2 longer than the 48 tokens seq_len 64 leaves" in out
    assert all(len(s.ids) <= 48 for s in data.splits["train"].rows)
    long_only = write_records(tmp_path / "long.jsonl", [records[1], records[4]])
    with pytest.raises(MTNLGError, match=r"long.jsonl: no prompt left to train on \(2 records read\)"):
        prompt_data(model_dir, long_only, seq_len=64, completion=16)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": question(1), "answer": 2}, r"p.jsonl:2: a prompt record needs prompt .*fields: answer, messages"),
        ({"prompt": 42}, r"p.jsonl:2: prompt is int, expected a string, or a list of turns"),
        ({"prompt": {"role": "user", "content": "x"}}, r"p.jsonl:2: prompt is dict, expected"),
        ({"prompt": ["What is 1 + 1?"]}, r"p.jsonl:2: a turn is str, expected an object with role and content"),
        ({"prompt": [{"role": "user"}]}, r"p.jsonl:2: a prompt turn has fields role; expected role and content"),
        ({"prompt": [{"text": "hi"}]}, r"p.jsonl:2: a turn has fields text; expected role and content"),
        ({"prompt": []}, r"p.jsonl:2: prompt must be a non-empty list of turns"),
        ({"prompt": "x", "completions": ["y"]}, r"p.jsonl:2: a field named completions would hide the reward funct"),
    ],
)
def test_a_bad_prompt_record_is_one_line_naming_it(model_dir, tmp_path, record, message):
    path = write_records(tmp_path / "p.jsonl", [{"prompt": "Fine."}, record])
    with pytest.raises(MTNLGError, match=message) as error:
        prompt_data(model_dir, path, chat_template="chatml")
    assert "\n" not in str(error.value)


def test_an_empty_prompt_is_one_line_unless_the_tokenizer_adds_its_own_tokens(model_dir, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes(Path(build_demo_data(progress=False)[1]).read_bytes())
    path = write_records(tmp_path / "p.jsonl", [{"prompt": "Fine."}, {"prompt": ""}])
    with pytest.raises(MTNLGError, match=r"p.jsonl:2: the prompt is empty \(no tokens to generate from\)"):
        prompt_data(plain, path, chat_template="chatml")
    data = prompt_data(model_dir, path)  # "" is the tokenizer's end-of-text token alone, as TRL tokenizes it
    assert [s.ids for s in data.splits["train"].rows if s.prompt == ""] == [[0]]


def test_prompt_data_needs_the_grpo_objective(model_dir, tmp_path):
    path = write_records(tmp_path / "p.jsonl", [{"prompt": "Fine."}])
    with pytest.raises(MTNLGError, match=r"trains on sequences; the data serves prompts: set model.objective grpo"):
        prompt_data(model_dir, path, objective=LanguageModelling())


def test_a_batch_of_prompts_aligns_columns_some_records_lack():
    from mtnlg_lightning.data.prompts import PromptSample

    samples = [PromptSample([5, 6], "a", {"answer": 1}), PromptSample([7], [{"role": "user", "content": "b"}], {})]
    batch = prompts_batch(samples)
    assert batch["prompt_ids"] == [[5, 6], [7]] and batch["prompt_tokens"].tolist() == [2, 1]
    assert batch["prompts"] == ["a", [{"role": "user", "content": "b"}]] and batch["columns"] == {"answer": [1, None]}
    assert samples[0].input_ids.dtype == np.int64


# ------------------------------------------------------------------------------------------------ loading rewards
REWARDS_FILE = """
from dataclasses import dataclass


@dataclass
class Unused:  # a dataclass loads: the module is registered while it runs
    x: int = 0


def contains_answer(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


def scaled(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


def broken(completions, **kwargs):
    return {}["tests"]
"""


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_FILE)
    return path


def test_each_kind_of_spec_loads_with_its_name_and_weight(rewards_file):
    functions = load_rewards(
        [
            "accuracy",
            "mtnlg_lightning.rewards.builtin:length",
            f"{rewards_file}:contains_answer",
            {"name": "format", "pattern": "<answer>.*</answer>", "as": "answer_tags"},
            {"name": f"{rewards_file}:scaled", "scale": 2.0},
        ],
        [1.0, 0.5, 2, -1.0, 0.25],
    )
    assert isinstance(functions, RewardFunctions) and len(functions) == 5
    assert functions.names == ["accuracy", "length", "contains_answer", "answer_tags", "scaled"]
    assert functions.weights.dtype == torch.float32 and functions.weights.tolist() == [1.0, 0.5, 2.0, -1.0, 0.25]
    assert load_rewards(["format", "length"]).weights.tolist() == [1.0, 1.0]
    assert load_rewards("format").names == ["format"]  # one spec alone

    completions = ["<answer>6</answer>", "I think 6", "<answer>7"]
    table = score(functions, ["p"] * 3, completions, [[1] * 4, [1] * 256, [1] * 600], {"answer": [6, 6, 6]})
    assert table.shape == (3, 5) and table.dtype == torch.float32
    assert table[:, 0].tolist() == [1.0, 1.0, 0.0]  # accuracy: 6, 6, 7
    assert table[:, 1].tolist() == [4 / 256, 1.0, 0.0]  # length around 256
    assert table[:, 2].tolist() == [1.0, 1.0, 0.0]
    assert table[:, 3].tolist() == [1.0, 0.0, 0.0]  # the bound pattern
    assert table[:, 4].tolist() == [2.0 * len(c) for c in completions]  # the bound scale


def test_a_bound_argument_wins_over_a_column_of_its_name():
    functions = load_rewards([{"name": "length", "target": 4}])
    table = score(functions, ["p", "p"], ["a", "b"], [[1] * 4, [1] * 2], {"target": [100, 100]})
    assert table[:, 0].tolist() == [1.0, 0.5]


def test_a_factory_makes_its_function_once_as_trls_get_functions():
    pytest.importorskip("trl")
    functions = load_rewards(
        [{"factory": "trl.rewards:get_soft_overlong_punishment", "max_completion_len": 100, "soft_punish_cache": 20}]
    )
    assert functions.names == ["soft_overlong_punishment_reward"]  # TRL's own name for it
    table = score(functions, ["p"] * 3, ["a"] * 3, [[1] * 50, [1] * 90, [1] * 120], {})
    assert table[:, 0].tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize(
    ("specs", "weights", "message"),
    [
        (["accuracy", "nonsense"], None, r"reward function 'nonsense' is none of a shipped name \(accuracy, format"),
        (["no_such_package.rewards:f"], None, r"reward function no_such_package.rewards:f: no module named no_such_p"),
        (["json:no_such_function"], None, r"reward function json:no_such_function: json has no no_such_function"),
        (["json:__name__"], None, r"json:__name__: __name__ is str, not a function"),
        (["missing/file.py:f"], None, r"reward function missing/file.py:f: no file missing/file.py"),
        (["FILE:nothing"], None, r"my_rewards.py:nothing: .*my_rewards.py has no nothing"),
        (
            [{"name": "format", "patern": "x"}],
            None,
            r"format has no parameter patern \(its parameters: completions, patt",
        ),
        ([{"name": "format", "completions": "x"}], None, r"completions cannot be bound \(the run passes it\)"),
        ([{"name": "format", "as": ""}], None, r"as must be a non-empty name"),
        ([{"pattern": "x"}], None, r"a mapping names its function by name: SPEC or factory: SPEC"),
        ([{"factory": "length", "target": 3}], None, r"the factory fails: TypeError: .*completion_ids"),
        ([{"factory": "json:dumps", "obj": 1}], None, r"the factory returns str, not a function"),
        ([3], None, r"reward function 3 is int: expected a shipped name"),
        (["format", {"name": "format", "pattern": "x"}], None, r"two reward functions are named format .*as: NAME"),
        (["format", "length"], [1.0], r"reward weights: 1 given for 2 reward functions"),
        (["format", "length"], [1.0, "heavy"], r"reward weights must be finite numbers, got 'heavy'"),
        (["format"], [math.nan], r"reward weights must be finite numbers, got nan"),
        ([], None, r"no reward functions: GRPO scores its completions with at least one"),
    ],
)
def test_what_does_not_load_is_one_line_naming_its_spec(rewards_file, specs, weights, message):
    specs = [s.replace("FILE", str(rewards_file)) if isinstance(s, str) else s for s in specs]
    with pytest.raises(MTNLGError, match=message) as error:
        load_rewards(specs, weights)
    assert "\n" not in str(error.value) and "Traceback" not in str(error.value)


def test_a_file_or_module_that_fails_on_import_is_one_line_with_the_place(tmp_path, monkeypatch):
    bad = tmp_path / "bad_rewards.py"
    bad.write_text("import json\n\nSETTINGS = json.loads('{oops')\n")
    with pytest.raises(MTNLGError, match=r"loading .*bad_rewards.py fails: JSONDecodeError: .*\(bad_rewards.py:3\)"):
        load_rewards([f"{bad}:f"])
    broken = tmp_path / "syntax_rewards.py"
    broken.write_text("def f(completions, **kwargs):\n    return [1.0 for c in completions\n")
    with pytest.raises(MTNLGError, match=r"syntax_rewards.py fails: SyntaxError: .*\(syntax_rewards.py:2\)") as error:
        load_rewards([f"{broken}:f"])
    assert "\n" not in str(error.value)
    package = tmp_path / "reward_pkg_failing"
    package.mkdir()
    (package / "__init__.py").write_text("import no_such_dependency_of_rewards\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MTNLGError, match=r"importing reward_pkg_failing fails: ModuleNotFoundError: No module named"):
        load_rewards(["reward_pkg_failing:f"])


# ------------------------------------------------------------------------------------------------ scoring
def test_none_is_nan_and_bools_numpy_and_tensor_scalars_are_numbers_as_trl_converts_them():
    def mixed(completions, **kwargs):
        return [None, True, np.float32(0.5), torch.tensor(2.0), 3, False]

    table = score(load_rewards_of(mixed), ["p"] * 6, ["c"] * 6, [[1]] * 6, {})
    # TRL: None -> nan, then torch.tensor(values, dtype=torch.float32)
    trl = torch.tensor([torch.nan if v is None else v for v in mixed([])], dtype=torch.float32)
    assert table.shape == (6, 1) and torch.equal(table[:, 0].isnan(), trl.isnan())
    assert table[1:, 0].tolist() == trl[1:].tolist() == [1.0, 0.5, 2.0, 3.0, 0.0]


def load_rewards_of(*functions) -> RewardFunctions:
    from mtnlg_lightning.rewards import RewardFunction

    return RewardFunctions(tuple(RewardFunction(f.__name__, f, 1.0, f.__name__) for f in functions))


LONG_PROMPT = "Please compute the sum of the following two large numbers carefully and explain: 123 + 456"


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda n: [1.0] * (n - 1), r"reward function bad returned 3 values for 4 completions \(one each\)"),
        (lambda n: [1.0, "1.0", 0.0, 0.0], r"bad returned str '1.0' for a completion of prompt 'second'; expected a"),
        (lambda n: [1.0, 0.0, [1.0], 0.0], r"bad returned list \[1.0\] for a completion of prompt 'third'"),
        (lambda n: "1.0", r"bad returned str on the completions of prompt 'Please compute the sum of the fo"),
        (lambda n: None, r"bad returned NoneType on the completions of prompt"),
    ],
)
def test_a_reward_function_returning_what_is_no_reward_is_one_line(returned, message):
    def bad(completions, **kwargs):
        return returned(len(completions))

    prompts = [LONG_PROMPT, "second", [{"role": "user", "content": "third"}], "fourth"]
    with pytest.raises(MTNLGError, match=message) as error:
        score(load_rewards_of(bad), prompts, ["c"] * 4, [[1]] * 4, {})
    assert "\n" not in str(error.value)


def test_a_reward_function_that_raises_is_one_line_naming_it_the_prompt_and_the_place(rewards_file):
    functions = load_rewards(["format", f"{rewards_file}:broken"])
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG_PROMPT}]
    with pytest.raises(MTNLGError) as error:
        score(functions, [prompt] * 2, ["c"] * 2, [[1]] * 2, {"answer": [1, 2]})
    assert str(error.value) == (
        "reward function broken fails on the completions of prompt 'Please compute the sum of the following two "
        "large numbers...': KeyError: 'tests' (my_rewards.py:19)"
    )
    with pytest.raises(MTNLGError, match=r"accuracy fails .*: ValueError: the records have no answer column"):
        score(load_rewards(["accuracy"]), ["p"], ["c"], [[1]], {"tests": [None]})
    with pytest.raises(MTNLGError, match=r"the prompt records have a field completions: .*rename the field"):
        score(load_rewards(["format"]), ["p"], ["c"], [[1]], {"completions": ["x"]})


def test_trls_shipped_reward_functions_score_unchanged():
    """trl.rewards' functions take conversational completions (`completion[0]["content"]`) and the token ids."""
    pytest.importorskip("trl")
    functions = load_rewards(
        [
            "trl.rewards:think_format_reward",
            {"factory": "trl.rewards:get_repetition_penalty_reward", "ngram_size": 2},
        ]
    )
    completions = [
        [{"role": "assistant", "content": "<think>\nSum.\n</think>\n42"}],
        [{"role": "assistant", "content": "<think>\nSum.\n42"}],
    ]
    prompts = [[{"role": "user", "content": "21 + 21?"}]] * 2
    table = score(functions, prompts, completions, [[1, 2, 3, 4], [5, 5, 5, 5, 5]], {"solution": ["42", "42"]})
    assert table.tolist() == [[1.0, 0.0], [0.0, -0.75]]
    pytest.importorskip("math_verify")  # trl.rewards.accuracy_reward needs it
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]
    boxed = [[{"role": "assistant", "content": rf"So \boxed{{{a}}}"}] for a in (r"\frac{1}{3}", r"\frac{1}{2}")]
    table = score(load_rewards(["trl.rewards:accuracy_reward"]), prompts, boxed, [[1], [1]], {"solution": solutions})
    assert table[:, 0].tolist() == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------ shipped rewards
def as_conversation(texts: list[str]) -> list[list[dict]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_accuracy_reads_the_last_boxed_answer_else_the_last_number_else_the_text():
    completions = [
        r"First \boxed{3}, then on reflection \boxed{\frac{12}{2}}",  # the last box, a fraction: 6
        "3 + 3 makes 6.",  # the last number
        "It costs $1,000.",  # thousands commas and a currency sign
        "Roughly 0.3333 or so",  # 1e-4 off, relatively
        "Paris",  # the whole text, against a string answer
        r"\boxed{ Paris }",
        "paris",  # case counts
        "no answer here",
        r"\boxed{x^{2} + 1}",  # nested braces
        "anything",
    ]
    answers = [6, "6", "1000", "0.33333333", "Paris", "Paris", "Paris", 7, "x^{2} + 1", None]
    expected = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, None]
    assert accuracy(completions, answers) == expected
    assert accuracy(as_conversation(completions), answers) == expected  # the conversational form
    assert accuracy(["about 2.0000001", "about 2.00001"], answer=[2, 2]) == [1.0, 0.0]  # relative 1e-6
    assert accuracy(["It is 42"], solution=["42"]) == [1.0]  # TRL's column name
    with pytest.raises(ValueError, match="no answer column"):
        accuracy(["42"])


def test_accuracy_judges_as_mathematics_with_math_verify():
    pytest.importorskip("math_verify")
    completions = [r"\boxed{\sqrt{4}}", r"so \boxed{2x + 2}", r"\boxed{\frac{2}{4}}", r"\boxed{3}"]
    assert accuracy(completions, [2, "2(x+1)", "0.5", 2]) == [1.0, 1.0, 1.0, 0.0]
    assert accuracy([r"\boxed{Paris}", r"\boxed{Pairs}"], ["Paris"] * 2) == [1.0, 0.0]  # words: the plain rule


def test_format_matches_the_whole_stripped_completion():
    completions = [
        "<think>\nadd them\n</think>\n<answer>6</answer>\n",
        "<think>add</think><answer>6</answer> and more",
        "<answer>6</answer>",
        "  <think>x</think> <answer>6</answer>  ",
    ]
    assert format(completions) == [1.0, 0.0, 0.0, 1.0]
    assert format(as_conversation(completions)) == [1.0, 0.0, 0.0, 1.0]
    assert format(completions, pattern=r"<answer>\d+</answer>") == [0.0, 0.0, 1.0, 0.0]


def test_length_peaks_at_its_target_and_falls_to_zero_at_none_and_twice_it():
    ids = [[1] * n for n in (0, 32, 64, 96, 128, 500)]
    assert length(ids, target=64) == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert length([[1] * DEFAULT_LENGTH_TARGET]) == [1.0]
    assert length([torch.ones(64, dtype=torch.long)], target=64) == [1.0]  # ids as tensors
    with pytest.raises(ValueError, match="target must be a number of tokens > 0"):
        length([[1]], target=0)


def test_num_iterations_serves_each_global_batch_that_many_times_in_a_row():
    """TRL's RepeatSampler with num_iterations mu: steps k mu ... (k + 1) mu - 1 serve global batch k; the count of
    samples (so of steps) is unchanged."""
    from mtnlg_lightning.data.packing import ShuffledRows
    from mtnlg_lightning.data.prompts import RepeatedBatches

    rows = ShuffledRows(list(range(10)), count=12, seed=3)
    repeated = RepeatedBatches(rows, global_batch_size=3, repeats=2)
    served = [repeated[i] for i in range(len(repeated))]
    assert len(repeated) == 12
    assert served[0:3] == served[3:6] == [rows[i] for i in range(3)]
    assert served[6:9] == served[9:12] == [rows[i] for i in range(3, 6)]
