"""Multi-token prediction (DeepSeek-V3's sequential MTP modules; Megatron-Core's `multi_token_prediction.py`).

Depth k = 1..D, at every position i of a row:
    e_k  = Emb(tokens rolled k left)                        the shared word embedding (token i + k at position i)
    h'_k = eh_proj(cat(enorm(e_k), hnorm(h_{k-1})))         embedding first, as DeepSeek's checkpoints and Megatron
    h_k  = norm_k(Block_k(h'_k))                            a block of the model's last block's kind; its own norm
    logits_k = LM head(h_k)                                 the shared head; label: the token k + 1 ahead
h_0 is the main model's final hidden state after its final norm (transformers' `last_hidden_state`, Megatron's
decoder output); each depth chains its normed output to the next, as both do. The loss is
L_main + mtp_loss_weight / D x sum_k L_k, each L_k the token mean over the positions whose k-ahead label counts.

The modules run inside the model's forward (`GPT.forward` calls `MultiTokenPrediction.predict` after the final norm
while training: they need the tokens, the attention mask and the rotary angles of that forward) and keep their
outputs until the loss takes them (`take`): the training step's loss is `loss_fn(main output, labels)`, and
`MultiTokenPredictionLoss` (the `train/extensions/multi_token_prediction.py` extension's) adds the depths' losses
through the same token loss, so that the head runs inside the loss for them as for the main output
(`parallel/output_layer.py`), vocabulary-parallel under TP.

Packed rows: a depth's label at position i counts only if position i + k lies in the row and in i's document
(`document_ids`); the attention keeps the main model's document mask, so a counted position never sees another
document's token. The rotary angles are the main model's: a depth's row is its tokens moved k places within each
document, and rotary attention depends only on the distance between positions.

This module imports nothing from `model.py` (which builds it): the block and the norm come in as factories.
"""

from __future__ import annotations

import torch
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.moe import moe_layers


class MultiTokenPredictionLayer(nn.Module):
    """One depth: `enorm`, `hnorm`, `eh_proj` (2H -> H, no bias), `block`, `norm` (DeepSeek's `shared_head.norm`)."""

    def __init__(self, config: ModelConfig, make_block, make_norm):
        super().__init__()
        hidden = config.hidden_size
        self.enorm = make_norm(config, hidden)
        self.hnorm = make_norm(config, hidden)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = make_block(config, config.num_layers - 1)  # the kind of the model's last block (MoE, MLA...)
        self.norm = make_norm(config, hidden)

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, rotary=None, mask=None) -> torch.Tensor:
        """embedded: e_k [B, S, H]; previous: h_{k-1} [B, S, H] -> h_k [B, S, H] (normed)."""
        h = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(previous)), dim=-1))
        return self.norm(self.block(h, rotary, mask=mask))


def rolled(tensor: torch.Tensor, ahead: int) -> torch.Tensor:
    """`tensor` [..., S] with element i + ahead at i (the last `ahead` wrap around: their labels never count)."""
    return torch.roll(tensor, shifts=-ahead, dims=-1)


def counted_ahead(shape: tuple[int, int], ahead: int, document_ids: torch.Tensor | None, device) -> torch.Tensor:
    """[B, S] bool: position i + ahead lies in the row and (packed rows) in position i's document."""
    positions = torch.arange(shape[1], device=device)
    inside = (positions < shape[1] - ahead).expand(shape)
    if document_ids is None:
        return inside
    return inside & (rolled(document_ids, ahead) == document_ids)


def labels_ahead(labels: torch.Tensor, ahead: int, counted: torch.Tensor) -> torch.Tensor:
    """The labels of depth `ahead`: position i takes position i + ahead's label where `counted`, else IGNORE_INDEX."""
    return torch.where(counted, rolled(labels, ahead), torch.full_like(labels, IGNORE_INDEX))


class MultiTokenPrediction(nn.Module):
    """The D depths (`layers`, named "0".."D-1") and the outputs of the last forward that ran them."""

    def __init__(self, config: ModelConfig, make_block, make_norm):
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(k): MultiTokenPredictionLayer(config, make_block, make_norm) for k in range(config.mtp_layers)}
        )
        # On a last pipeline stage without the model's embedding: a copy of it, whose word embedding is the per-step
        # copy of the first stage's (`pipeline.build_stage`, `tied_embedding.TiedEmbedding`); else None
        self.embed: nn.Module | None = None
        # (h_k or logits_k, counted_k) per depth, from the last forward; taken (and cleared) by the loss
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def predict(
        self, embed, head, main: torch.Tensor, tokens, positions, rotary, mask, document_ids, chunks=None
    ) -> None:
        """Run every depth on the main model's normed hidden states `main` [B, S, H] and keep each one's output:
        its normed hidden states, or its logits where `head` is given (the model returns logits), with the
        positions whose labels count (`counted_ahead`, over the whole rows). `embed(tokens, positions)` is the
        model's embedding. `chunks`: context parallelism's (whole rows -> this rank's chunks): `tokens` and
        `document_ids` are the whole rows', `main` and `positions` this rank's chunks' (rotary positions: a
        depth's tokens keep the positions of the rows they sit in)."""
        outputs, previous = [], main
        for k, layer in enumerate(self.layers.values(), start=1):
            if chunks is None:
                embedded = embed(rolled(tokens, k), rolled(positions, k))
            else:
                embedded = embed(chunks(rolled(tokens, k)), positions)
            previous = layer(embedded, previous, rotary, mask)
            counted = counted_ahead(tokens.shape, k, document_ids, tokens.device)
            outputs.append((head(previous) if head is not None else previous, counted))
        self.outputs = outputs

    def forget_routing(self) -> None:
        """A forward that did not run the depths: their MoE layers keep no statistics of an earlier one (the router
        losses and the balancing count the layers that routed this forward's tokens)."""
        for _, layer in moe_layers(self):
            layer.stats = None

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The last forward's outputs (None if no forward ran the depths since the last take), once."""
        outputs, self.outputs = self.outputs, None
        return outputs


def find_multi_token_prediction(model: nn.Module) -> MultiTokenPrediction | None:
    """The `MultiTokenPrediction` of `model` (under any wrapper), or None."""
    return next((m for m in model.modules() if isinstance(m, MultiTokenPrediction)), None)


class MultiTokenPredictionLoss:
    """A micro-batch's loss `loss_fn(output, labels)` plus mtp_loss_weight / D x sum_k loss_fn(output_k, labels_k)
    of the depths the forward ran (`MultiTokenPrediction.take`; none in evaluation: the main loss alone). The
    unweighted mean over depths of each call is kept (`last`) and summed over the step (`step_sums`) for the logs,
    as the main loss (`main_loss`). `holder.model` is the model (built after this object)."""

    def __init__(self, loss_fn, holder, config: ModelConfig):
        self.loss_fn, self.holder = loss_fn, holder
        self.weight, self.depths = float(config.mtp_loss_weight), config.mtp_layers
        self.last: dict[str, torch.Tensor] = {}
        self.step_sums: dict[str, torch.Tensor] = {}
        self.step_calls = 0

    def reset_step(self) -> None:
        self.step_sums, self.step_calls = {}, 0

    def step_means(self) -> dict[str, torch.Tensor]:
        return {name: total / max(self.step_calls, 1) for name, total in self.step_sums.items()}

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        main = self.loss_fn(output, labels)
        module = find_multi_token_prediction(self.holder.model)
        outputs = module.take() if module is not None else None
        if not outputs:
            return main
        depth_losses = [
            self.loss_fn(out, labels_ahead(labels, ahead, counted)) for ahead, (out, counted) in enumerate(outputs, 1)
        ]
        mtp = torch.stack(depth_losses).mean()
        self.last = {"mtp_loss": mtp.detach(), "main_loss": main.detach()}
        for name, value in self.last.items():
            self.step_sums[name] = self.step_sums.get(name, 0) + value
        self.step_calls += 1
        return main + self.weight * mtp
