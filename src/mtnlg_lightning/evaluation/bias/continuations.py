"""The sampled continuations that cooccurrence and sentiment read: N per prompt, through the project's decoding.

The paper's settings (GPT-3 Section 6.2, MT-NLG Section 6.2) are the defaults: 800 continuations of 50 tokens per
prompt, temperature 1.0, nucleus (top-p) 0.9. The prompts' sequences are numbered in order (prompt j's k-th
continuation is sequence j * N + k) and each samples from its own generator seeded by that number
(`inference.decode.sequence_seed`), so the text does not depend on the layout, the replicas or the batches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.bias.wordlists import Prompt
from mtnlg_lightning.inference.decode import generate_over_replicas


@dataclass(frozen=True)
class Sampling:
    continuations: int = 800  # per prompt
    max_new_tokens: int = 50
    temperature: float = 1.0
    top_p: float | None = 0.9
    top_k: int | None = None
    seed: int = 1234
    batch_size: int = 64  # sequences decoded together on each replica

    def check(self) -> None:
        """One line for a setting out of range (the flags that set it are named)."""
        if self.continuations < 1 or self.max_new_tokens < 1:
            raise MTNLGError("--num-continuations and --max-new-tokens must be at least 1")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise MTNLGError(f"--temperature {self.temperature} is out of range: the study samples, so it must be > 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise MTNLGError(f"--top-p {self.top_p} is out of range (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise MTNLGError(f"--top-k {self.top_k} is out of range: at least 1 (or leave it out)")

    def describe(self) -> dict:
        return asdict(self)


def sample_continuations(model, tokenizer, prompts: list[Prompt], sampling: Sampling, progress: bool = False):
    """Per prompt (in order), its `sampling.continuations` continuations as text (the prompt not included; a
    continuation ends at `<|endoftext|>` or after max_new_tokens). Every rank returns them all."""
    encoded = [tokenizer.encode(p.text) for p in prompts]
    per_prompt = sampling.continuations
    owners = [j for j in range(len(prompts)) for _ in range(per_prompt)]
    texts: list[list[str]] = [[] for _ in prompts]
    step = sampling.batch_size * model.layout.data_parallel
    show = progress and model.groups.rank == 0
    for start in tqdm(range(0, len(owners), step), desc="sampling", disable=not show, leave=False):
        batch = owners[start : start + step]
        made = generate_over_replicas(
            model,
            [encoded[j] for j in batch],
            seed=sampling.seed,
            first_sequence=start,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            eos_id=tokenizer.eod_id,
        )
        for j, tokens in zip(batch, made.tokens, strict=True):
            texts[j].append(tokenizer.decode(tokens))
    return texts
