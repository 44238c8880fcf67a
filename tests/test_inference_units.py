"""The pieces of inference in a layout, in one process: vocab-parallel log-likelihoods and argmax over TP shards
(threads over a real process group) equal a log-softmax over the real vocabulary, the padded rows never scored; the
model's own forward with a KV cache equals the full forward, in one process and on TP shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from threaded_group import run_ranks

from mtnlg_lightning.config import get_config
from mtnlg_lightning.inference.scoring import vocab_parallel_token_scores
from mtnlg_lightning.model import KVCache, build_model
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel


def test_vocab_parallel_scores_equal_log_softmax_over_the_real_vocabulary_and_never_score_padding():
    torch.manual_seed(0)
    vocab, padded = 1000, 1024  # 24 padding rows, on the last shard
    logits = torch.randn(6, padded)
    logits[:, vocab:] = 50.0  # padding that would win every argmax and dominate the sum if it took part
    targets = torch.tensor([3, 999, 511, 512, 700, 0])
    logits[0, 3] = 9.0  # row 0: its target is the argmax
    logits[1, 999] = logits[1, 3] = 9.0  # row 1: a tie; torch.argmax takes the first (3), so not greedy
    logits[2, 511] = 9.0  # row 2: the argmax at the last column of shard 0 of 2
    logits[3, 512] = 9.0  # row 3: ... and at the first column of shard 1
    expected = F.log_softmax(logits[:, :vocab], dim=-1)
    expected_logprob = expected.gather(-1, targets[:, None]).squeeze(-1)
    expected_greedy = expected.argmax(-1) == targets
    assert expected_greedy.tolist() == [True, False, True, True, False, False]

    def shard(rank: int, size: int):
        import torch.distributed as dist

        width = padded // size
        part = logits[:, rank * width : (rank + 1) * width]
        return vocab_parallel_token_scores(part, targets, rank * width, vocab, dist.group.WORLD)

    for size in (2, 4):
        for logprob, greedy in run_ranks(size, lambda rank, size=size: shard(rank, size)):
            torch.testing.assert_close(logprob, expected_logprob, rtol=1e-6, atol=1e-5)
            assert greedy.tolist() == expected_greedy.tolist()
    logprob, greedy = vocab_parallel_token_scores(logits, targets, 0, vocab, None)  # one rank: the whole vocabulary
    torch.testing.assert_close(logprob, expected_logprob)
    assert greedy.tolist() == expected_greedy.tolist()


def decode(model, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Last-position logits after a prefill of `prefill` tokens and then one token at a time, through the cache."""
    cache = KVCache(tokens.shape[1])
    outs = [model(tokens[:, :prefill], cache)[:, -1]]
    for position in range(prefill, tokens.shape[1]):
        cache.start = position
        outs.append(model(tokens[:, position : position + 1], cache)[:, -1])
    return torch.stack(outs, dim=1)


@torch.no_grad()
def test_forward_with_a_kv_cache_equals_the_full_forward_in_one_process_and_on_tp_shards():
    config = get_config("tiny")
    torch.manual_seed(0)
    reference = build_model(config).eval()
    tokens = torch.randint(0, config.vocab_size, (3, 12))
    full = reference(tokens)[:, 4:]  # the positions the decoding loop predicts from
    torch.testing.assert_close(decode(reference, tokens, 5), full, rtol=1e-5, atol=1e-5)

    def tp_rank(rank: int):
        import copy

        import torch.distributed as dist

        model = apply_tensor_parallel(copy.deepcopy(reference), dist.group.WORLD, rank, 2)
        with torch.no_grad():
            return decode(model, tokens, 5)

    for rank, shard in enumerate(run_ranks(2, tp_rank)):
        width = config.padded_vocab_size() // 2
        torch.testing.assert_close(shard, full[..., rank * width : (rank + 1) * width], rtol=1e-5, atol=1e-5)


def test_rows_continuing_the_same_prompt_share_one_prefill_and_sample_as_if_alone():
    """GRPO's G completions of a prompt: the prefill runs once per distinct prompt (the rows the model sees), and each
    row's completion is the one it gets generated alone with its seed (sampling, temperature 1)."""
    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.inference.decode import generate_batch
    from mtnlg_lightning.inference.sharded_model import ShardedModel
    from mtnlg_lightning.model import build_model

    torch.manual_seed(0)
    model = build_model(get_config("tiny")).eval()
    first, second = [5, 9, 13, 2, 7], [11, 3, 8]
    prompts, seeds = [first, first, second, second, first], [1, 2, 3, 4, 5]
    widths = []
    model.register_forward_pre_hook(lambda module, args: widths.append(tuple(args[0].shape)))
    together = generate_batch(ShardedModel.whole(model), prompts, 6, seeds=seeds).tokens
    assert widths[0] == (2, 3)  # the prefill: two distinct prompts, up to the shortest's length
    assert all(batch == 5 for batch, _ in widths[1:])
    for prompt, seed, tokens in zip(prompts, seeds, together, strict=True):
        assert generate_batch(ShardedModel.whole(model), [prompt], 6, seeds=[seed]).tokens[0] == tokens
    assert together[0] != together[1]  # the same prompt, its own sampler
