"""The GPT decoder: shapes, causality, tied embeddings, Megatron init, presets and parameter counts."""

import math

import pytest
import torch

from mtnlg_lightning.config import PRESETS, get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import count_parameters
from mtnlg_lightning.model import build_model


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return build_model(get_config("tiny"))


def test_logits_have_batch_sequence_and_padded_vocab_shape(tiny):
    tokens = torch.randint(0, 4096, (3, 17))
    assert tiny(tokens).shape == (3, 17, get_config("tiny").padded_vocab_size())


def test_future_tokens_do_not_change_past_logits(tiny):
    tokens = torch.randint(0, 4096, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = torch.randint(0, 4096, (2, 12))
    with torch.no_grad():
        a, b = tiny(tokens), tiny(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_lm_head_is_tied_to_the_input_embedding(tiny):
    assert tiny.lm_head.weight is tiny.embed.wte.weight
    assert sum(p is tiny.embed.wte.weight for p in tiny.parameters()) == 1


def test_vocab_is_padded_to_a_multiple_of_128_times_tp():
    config = get_config("mtnlg-530b")
    assert config.padded_vocab_size() == 50304
    assert config.padded_vocab_size(tensor_parallel=8) == 51200


def test_init_std_is_sqrt_one_over_3h_and_output_projections_are_scaled():
    config = get_config("tiny", hidden_size=256, num_heads=4, num_layers=8)
    torch.manual_seed(0)
    model = build_model(config)
    std = math.sqrt(1 / (3 * 256))
    assert config.init_std == pytest.approx(std)
    assert model.blocks["0"].attn.qkv.weight.std().item() == pytest.approx(std, rel=0.03)
    assert model.embed.wte.weight.std().item() == pytest.approx(std, rel=0.03)
    scaled = std / math.sqrt(2 * 8)
    assert model.blocks["3"].attn.proj.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert model.blocks["3"].mlp.fc2.weight.std().item() == pytest.approx(scaled, rel=0.03)
    assert torch.all(model.blocks["0"].mlp.fc1.bias == 0) and torch.all(model.norm.weight == 1)


def test_530b_preset_has_about_530_billion_parameters_counted_on_meta():
    config = get_config("mtnlg-530b")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.seq_len) == (105, 20480, 128, 2048)
    model = build_model(config, device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == count_parameters(config)
    assert 525e9 <= counted <= 535e9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_count_matches_the_built_model(name):
    config = get_config(name)
    model = build_model(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)


def test_gpt3_presets_are_their_nominal_sizes():
    assert count_parameters(get_config("gpt3-175b")) == pytest.approx(175e9, rel=0.01)
    assert count_parameters(get_config("gpt3-1.3b")) == pytest.approx(1.3e9, rel=0.02)
    assert count_parameters(get_config("gpt3-125m")) == pytest.approx(125e6, rel=0.02)


def test_unknown_preset_is_a_one_line_error():
    with pytest.raises(MTNLGError, match="unknown model preset 'gpt5'.*choose one of"):
        get_config("gpt5")


def test_seq_len_above_the_position_table_is_an_error():
    with pytest.raises(MTNLGError, match="seq_len 4096 is above the position table size 2048"):
        get_config("gpt3-125m", seq_len=4096)


def test_heads_must_divide_hidden():
    with pytest.raises(MTNLGError, match="not divisible by num_heads 5"):
        get_config("tiny", num_heads=5)
