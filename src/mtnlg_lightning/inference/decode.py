"""Decoding in any layout (one process is 1 x 1 x 1): the model's own blocks with a per-stage KV cache.

Each step runs the new position(s) through the stages; the last stage gathers the last position's vocabulary slices
over TP ([batch, vocab], one position, not the sequence), TP rank 0 picks the next tokens and sends them to its TP
peers, and the last stage sends them with a stop flag along the pipeline, so every rank of the replica has every
token and all stop together. Prompts of different lengths share a batch: the prefill covers the shortest prompt, and
a longer prompt's remaining tokens are fed (forced) one position at a time while the others decode, so every
sequence sees exactly its own positions and no mask or padding enters the arithmetic. Rows that continue the same
prompt (GRPO's completions of a group) share one prefill: it runs on the distinct prompts, and the KV cache's rows are
copied out to the rows that continue each.

Under expert parallelism the replicas of an EP group run every MoE layer's all-to-alls together, so they take the
same number of forward passes (`InStep`): a replica whose sequences have all ended, or that was dealt none, passes one
token through until every replica of its group has ended (as scoring pads the replicas' batches to one count).

Each sequence samples from its own generator, seeded from the run's seed and the sequence's number, so what a
sequence gets does not depend on which other sequences share its batch or replica: the same command prints the same
text in every layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.sampling import EOS, LENGTH, POSITIONS, Generation, sample
from mtnlg_lightning.inference.sharded_model import ShardedModel
from mtnlg_lightning.model import KVCache
from mtnlg_lightning.parallel.tensor_parallel import gather_tensor_parallel

OnToken = Callable[[int, list[int]], None]  # (sequence, its tokens so far)
StopText = Callable[[list[int]], bool]  # whether a sequence's tokens so far end in a stop text (a chat's end of turn)


DECODING = ("max_new_tokens", "temperature", "top_k", "top_p")


def decoding_of(settings) -> dict:
    """How to decode, as generate_batch's keyword arguments, from the same-named attributes of `settings` (a
    command's parsed flags, a study's sampling settings)."""
    return {name: getattr(settings, name) for name in DECODING}


def sequence_seed(seed: int, sequence: int) -> int:
    """The seed of one sequence's generator: distinct per (seed, sequence), the same in every layout."""
    return (seed * 1_000_003 + sequence) % 2**63


class InStep:
    """The forward passes of the replicas of one EP group, kept in step: each pass is followed by `all_ended`, the
    agreement whether every replica has ended; a replica that has ended (or has nothing to decode) `idle`s, passing
    one token through per pass of the others. Without expert parallelism each replica goes alone."""

    def __init__(self, model: ShardedModel):
        self.model = model
        self.group = model.groups.expert_parallel_group if model.layout.expert_parallel > 1 else None

    def all_ended(self, ended: bool) -> bool:
        if self.group is None:
            return ended
        flag = torch.tensor([int(ended)], device=self.model.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def idle(self) -> None:
        if self.group is None:
            return
        model = self.model
        token = torch.zeros(1, model.padded_width(1), dtype=torch.long)
        ended = False
        while not ended:  # a pass, then the agreement, as the replicas still decoding take them
            model.forward([token if model.is_first else tuple(token.shape)], lambda m, logits: None)
            ended = self.all_ended(True)


def check_prompts(prompts: list[list[int]], limit: int) -> None:
    for prompt in prompts:
        if not prompt:
            raise MTNLGError("the prompt is empty (it needs at least one token)")
        if len(prompt) >= limit:
            raise MTNLGError(f"the prompt has {len(prompt)} tokens; the model's position limit is {limit}")


def distinct_rows(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first row of each distinct prompt, in order; for every row, its prompt's place among those)."""
    place: dict[tuple[int, ...], int] = {}
    shared = [place.setdefault(tuple(p), len(place)) for p in prompts]
    firsts = [shared.index(i) for i in range(len(place))]
    return torch.tensor(firsts, dtype=torch.long), torch.tensor(shared, dtype=torch.long)


@torch.inference_mode()
def generate_batch(
    model: ShardedModel,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Collection[int] | None = None,
    seeds: list[int | None] | None = None,
    use_cache: bool = True,
    on_token: OnToken | None = None,
    stop_text: StopText | None = None,
) -> Generation:
    """Continue every prompt (token ids) in one batch on this replica; every rank of it returns the `Generation`.
    `eos_id`: the token(s) that end a sequence (left out of its tokens). `stop_text(tokens)`: whether a sequence
    ends with the token just made (kept: the caller cuts the text), for an end marker that is several tokens.
    `seeds[i]`: the seed of prompt i's sampling (None: torch's default generator). `use_cache=False` re-runs the
    whole prefix for every token (the baseline the cache is measured against). `on_token(i, tokens)` is called as
    prompt i's tokens are made, on every rank of the replica."""
    limit, vocab = model.config.max_position_embeddings, model.config.vocab_size
    if model.sequence_parallel:
        raise MTNLGError("decoding cuts no sequence over TP: load the model without sequence_parallel to generate")
    check_prompts(prompts, limit)
    eos_ids = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    started = time.perf_counter()
    lengths = [len(p) for p in prompts]
    steps = [min(max_new_tokens, limit - n) for n in lengths]
    total = max(n + s for n, s in zip(lengths, steps, strict=True))
    sequence = torch.zeros(len(prompts), total, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        sequence[row, : len(prompt)] = torch.tensor(prompt)
    layout, coord = model.layout, model.groups.coord
    last_pp = model.holder[model.num_stages - 1]
    tp_source = layout.rank(last_pp, coord.dp, 0, coord.cp)
    pp_source = layout.rank(last_pp, coord.dp, coord.tp, coord.cp)
    generators = None
    if temperature > 0 and model.groups.rank == tp_source:  # the replica's sampler: one generator per sequence
        generators = [
            torch.Generator(device=model.device).manual_seed(s) if s is not None else None
            for s in (seeds or [None] * len(prompts))
        ]
    cache = KVCache(total) if use_cache else None
    in_step = InStep(model)
    out: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    stop = [""] * len(prompts)
    position, following = 0, min(lengths)
    decision = torch.zeros(len(prompts) + 1, dtype=torch.long, device=model.device)  # next tokens + stop flag
    chosen: dict[str, torch.Tensor] = {}
    # Rows that continue the same prompt (GRPO's G completions) share one prefill: the distinct prompts run, then
    # the cache's and the logits' rows are copied out to every row (each still samples with its own generator).
    firsts, shared = distinct_rows(prompts)
    prefill_rows = firsts if cache is not None and len(firsts) < len(prompts) else None

    def on_output(m: int, logits: torch.Tensor) -> None:
        last = logits[:, -1]
        if model.tp_group is not None:
            last = gather_tensor_parallel(last, 1, model.tp_group)
        if prefill_rows is not None and position == 0:
            last = last.index_select(0, shared.to(last.device))
        tokens = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)
        if model.groups.rank == tp_source:
            sampling = [following >= n for n in lengths]  # a row still inside its prompt is fed, not sampled
            tokens = sample_each(last[:, :vocab], temperature, top_k, top_p, generators, sampling)
        if model.tp_group is not None:
            dist.broadcast(tokens, src=tp_source, group=model.tp_group)
        chosen["tokens"] = tokens
        scaled = last[:, :vocab].float() / (temperature if temperature > 0 else 1.0)
        chosen["logprobs"] = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1).cpu()

    while True:
        if cache is not None:
            cache.start = position
            feed = sequence[:, position:following]
        else:
            feed = sequence[:, :following]
        if prefill_rows is not None and position == 0:
            feed = feed[prefill_rows]
        model.forward([feed if model.is_first else tuple(feed.shape)], on_output, caches=[cache] if cache else None)
        if prefill_rows is not None and position == 0:
            cache.expand_rows(shared)
        if model.is_last:
            nxt = chosen["tokens"].cpu()
            flag = all(
                stop[i]
                or following >= lengths[i]
                and (
                    len(out[i]) + 1 >= steps[i]
                    or int(nxt[i]) in eos_ids
                    or stop_text is not None
                    and stop_text(out[i] + [int(nxt[i])])
                )
                for i in range(len(prompts))
            )
            decision.copy_(torch.cat([nxt, torch.tensor([int(flag)])]))
        if layout.pipeline_parallel > 1:
            dist.broadcast(decision, src=pp_source, group=model.groups.pipeline_parallel_group)
        nxt, finished = decision[:-1].cpu(), bool(decision[-1])
        for i in range(len(prompts)):
            if following < lengths[i]:  # still inside this prompt: its own next token is fed instead
                continue
            if not stop[i]:
                if int(nxt[i]) in eos_ids:
                    stop[i] = EOS
                else:
                    out[i].append(int(nxt[i]))
                    if model.is_last:
                        logprobs[i].append(float(chosen["logprobs"][i]))
                    sequence[i, following] = nxt[i]
                    if on_token is not None:
                        on_token(i, out[i])
                    if stop_text is not None and stop_text(out[i]):
                        stop[i] = EOS
                    elif len(out[i]) == steps[i]:
                        stop[i] = LENGTH if steps[i] == max_new_tokens else POSITIONS
        if in_step.all_ended(finished):
            break
        if finished:  # the others of the EP group go on
            in_step.idle()
            break
        position, following = following, following + 1
    ended = [s or (LENGTH if steps[i] == max_new_tokens else POSITIONS) for i, s in enumerate(stop)]
    return Generation(out, ended, time.perf_counter() - started, logprobs if model.is_last else None)


def sample_each(logits: torch.Tensor, temperature: float, top_k, top_p, generators, sampling=None) -> torch.Tensor:
    """The next token of each row of `logits` [B, V], each row sampled with its own generator (argmax at 0).
    `sampling[i]` False: row i's token is not used (the row is still inside its prompt), so its generator draws
    nothing: a sequence's draws do not depend on the prompts it shares a batch with."""
    greedy = logits.argmax(dim=-1)
    if temperature <= 0:
        return greedy
    rows = [
        sample(logits[i : i + 1], temperature, top_k, top_p, g)
        if sampling is None or sampling[i]
        else greedy[i : i + 1]
        for i, g in enumerate(generators)
    ]
    return torch.cat(rows)


def generate_over_replicas(
    model: ShardedModel, prompts: list[list[int]], seed: int | None = None, first_sequence: int = 0, **kwargs
):
    """`generate_batch` with the prompts dealt over the data-parallel replicas, prompt i seeded with
    `sequence_seed(seed, first_sequence + i)` (a caller cutting a long list into batches numbers them on, so what a
    sequence gets depends neither on the layout nor on the batches); every rank returns every prompt's (tokens, stop
    reason) in order, and the slowest replica's seconds."""
    dp, rank = model.layout.data_parallel, model.groups.coord.dp
    mine = list(range(rank, len(prompts), dp))
    found = {}
    seconds = 0.0
    if mine:
        seeds = [sequence_seed(seed, first_sequence + i) if seed is not None else None for i in mine]
        on_token = kwargs.pop("on_token", None)
        if on_token is not None:  # numbered as the caller numbers them
            kwargs["on_token"] = lambda row, tokens: on_token(mine[row], tokens)
        result = generate_batch(model, [prompts[i] for i in mine], seeds=seeds, **kwargs)
        found = {i: (t, s) for i, t, s in zip(mine, result.tokens, result.stop, strict=True)}
        seconds = result.seconds
    else:
        InStep(model).idle()  # the EP group's other replicas decode theirs
    if dp > 1:
        parts = [None] * dp
        dist.all_gather_object(parts, (found, seconds), group=model.groups.data_parallel_group)
        found = {k: v for part, _ in parts for k, v in part.items()}
        seconds = max(s for _, s in parts)
    return Generation([found[i][0] for i in range(len(prompts))], [found[i][1] for i in range(len(prompts))], seconds)


def generate(
    model: ShardedModel | torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    eos_id: int | Collection[int] | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: OnToken | None = None,
    stop_text: StopText | None = None,
) -> Generation:
    """Continue one prompt `num_samples` times in one batch on this replica (a whole model in this process, or a
    `ShardedModel` whose replica decodes it together), sample i seeded with `sequence_seed(seed, i)`."""
    if not isinstance(model, ShardedModel):
        model = ShardedModel.whole(model)
    seeds = [sequence_seed(seed, i) if seed is not None else None for i in range(num_samples)]
    return generate_batch(
        model,
        [prompt] * num_samples,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        eos_id,
        seeds,
        use_cache,
        on_token,
        stop_text,
    )
