"""Generation in a layout: the model's own blocks decode with a per-stage KV cache (TP shards cache their heads).

Each step runs the new position(s) through the stages; the last stage gathers the last position's vocabulary
slices over TP ([batch, vocab], one position, not the sequence), TP rank 0 picks the next tokens (greedy, or
sampled from its one seeded generator) and sends them to its TP peers, and the last stage sends them with a stop
flag along the pipeline, so every rank of the replica has every token and all stop together. Prompts of different
lengths share a batch: the prefill covers the shortest prompt, and a longer prompt's remaining tokens are fed
(forced) one position at a time while the others decode, so every sequence sees exactly its own positions and no
mask or padding enters the arithmetic. Prompts are dealt over data-parallel replicas.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.engine import ShardedModel
from mtnlg_lightning.inference.sampling import EOS, LENGTH, POSITIONS, Generation, sample
from mtnlg_lightning.model import KVCache
from mtnlg_lightning.parallel.tensor_parallel import gather_tensor_parallel


@torch.inference_mode()
def generate_batch(
    model: ShardedModel,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
):
    """Continue every prompt (token ids) in one batch on this replica; every rank of it returns the `Generation`."""
    limit, vocab = model.config.max_position_embeddings, model.config.vocab_size
    if model.sequence_parallel:
        raise MTNLGError("decoding cuts no sequence over TP: load the model without sequence_parallel to generate")
    for prompt in prompts:
        if not prompt:
            raise MTNLGError("the prompt is empty (it needs at least one token)")
        if len(prompt) >= limit:
            raise MTNLGError(f"the prompt has {len(prompt)} tokens; the model's position limit is {limit}")
    started = time.perf_counter()
    lengths = [len(p) for p in prompts]
    steps = [min(max_new_tokens, limit - n) for n in lengths]
    total = max(n + s for n, s in zip(lengths, steps, strict=True))
    batch = torch.zeros(len(prompts), total, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, : len(prompt)] = torch.tensor(prompt)
    layout, coord = model.layout, model.groups.coord
    last_pp = model.holder[model.num_stages - 1]
    tp_source = layout.rank(last_pp, coord.dp, 0)
    pp_source = layout.rank(last_pp, coord.dp, coord.tp)
    generator = None
    if seed is not None and dist.get_rank() == tp_source:  # the one generator of this replica
        generator = torch.Generator(device=model.device).manual_seed(seed)
    cache = KVCache(total)
    out: list[list[int]] = [[] for _ in prompts]
    stop = [""] * len(prompts)
    position, feed = 0, batch[:, : min(lengths)]
    decision = torch.zeros(len(prompts) + 1, dtype=torch.long, device=model.device)  # next tokens + stop flag
    chosen: dict[str, torch.Tensor] = {}

    def on_output(m: int, logits: torch.Tensor) -> None:
        last = logits[:, -1]
        if model.tp_group is not None:
            last = gather_tensor_parallel(last, 1, model.tp_group)
        tokens = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)
        if dist.get_rank() == tp_source:
            tokens = sample(last[:, :vocab], temperature, top_k, top_p, generator)
        if model.tp_group is not None:
            dist.broadcast(tokens, src=tp_source, group=model.tp_group)
        chosen["tokens"] = tokens

    while True:
        cache.start = position
        model.forward([feed if model.is_first else tuple(feed.shape)], on_output, caches=[cache])
        following = position + feed.shape[1]  # the position the chosen tokens take
        if model.is_last:
            nxt = chosen["tokens"].cpu()
            flag = all(
                stop[i] or following >= lengths[i] and (len(out[i]) + 1 >= steps[i] or nxt[i] == eos_id)
                for i in range(len(prompts))
            )
            decision.copy_(torch.cat([nxt, torch.tensor([int(flag)])]))
        if layout.pipeline_parallel > 1:
            dist.broadcast(decision, src=pp_source, group=model.groups.pipeline_parallel_group)
        nxt, finished = decision[:-1].cpu(), bool(decision[-1])
        for i in range(len(prompts)):
            if following < lengths[i]:  # still inside this prompt: its own next token is fed instead
                nxt[i] = batch[i, following]
            elif not stop[i]:
                if int(nxt[i]) == eos_id:
                    stop[i] = EOS
                else:
                    out[i].append(int(nxt[i]))
                    if len(out[i]) == steps[i]:
                        stop[i] = LENGTH if steps[i] == max_new_tokens else POSITIONS
        if finished:
            break
        position, feed = following, nxt[:, None]
    ended = [s or (LENGTH if steps[i] == max_new_tokens else POSITIONS) for i, s in enumerate(stop)]
    return Generation(out, ended, time.perf_counter() - started)


def generate_over_replicas(model: ShardedModel, prompts: list[list[int]], **kwargs):
    """`generate_batch` with the prompts dealt over the data-parallel replicas; every rank returns every prompt's
    (tokens, stop reason) in order, and the slowest replica's seconds."""
    dp, rank = model.layout.data_parallel, model.groups.coord.dp
    mine = list(range(rank, len(prompts), dp))
    found = {}
    seconds = 0.0
    if mine:
        result = generate_batch(model, [prompts[i] for i in mine], **kwargs)
        found = {i: (t, s) for i, t, s in zip(mine, result.tokens, result.stop, strict=True)}
        seconds = result.seconds
    if dp > 1:
        parts = [None] * dp
        dist.all_gather_object(parts, (found, seconds), group=model.groups.data_parallel_group)
        found = {k: v for part, _ in parts for k, v in part.items()}
        seconds = max(s for _, s in parts)
    return Generation([found[i][0] for i in range(len(prompts))], [found[i][1] for i in range(len(prompts))], seconds)
