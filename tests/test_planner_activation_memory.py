"""The planner's activation memory per layer (Korthikanti et al.) against the bytes autograd really keeps, for
one process and for TP + sequence parallelism (ranks as threads of this process)."""

import copy

import pytest
import torch
import torch.distributed as dist
from threaded_group import run_ranks

from mtnlg_lightning.config import get_config
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mtnlg_lightning.planning.planner import activation_bytes_per_layer
from testing.activation_memory import saved_bytes_per_layer

BATCH, SEQ = 2, 256
CONFIG = get_config("tiny", hidden_size=128, num_heads=4, seq_len=SEQ, max_position_embeddings=SEQ)


def measured(tp: int, sequence_parallel: bool) -> int:
    torch.manual_seed(0)
    base = build_model(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    if tp == 1:
        return max(saved_bytes_per_layer(base, tokens))

    def rank_fn(rank):
        model = apply_tensor_parallel(
            copy.deepcopy(base), dist.group.WORLD, rank, tp, sequence_parallel=sequence_parallel
        )
        return max(saved_bytes_per_layer(model, tokens))

    return max(run_ranks(tp, rank_fn))


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, True), (4, True)])
def test_planner_activation_bytes_agree_with_what_autograd_keeps_within_10_percent(tp, sequence_parallel):
    # The planner counts bf16 activations; this fp32 run keeps twice the bytes. Flash-style attention keeps no
    # s x s scores, which is the planner's `selective` term.
    predicted = 2 * activation_bytes_per_layer(CONFIG, BATCH, tp, "selective", sequence_parallel=sequence_parallel)
    assert measured(tp, sequence_parallel) == pytest.approx(predicted, rel=0.10)
