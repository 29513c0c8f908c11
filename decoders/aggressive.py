"""Aggressive decoding: a non-autoregressive model drafts the output, the autoregressive model verifies.

Reference: Ge, Xia, Sun, Chen, Wei 2022, "Lossless Acceleration for Seq2seq Generation with
Aggressive Decoding" (Generalized Aggressive Decoding, GAD). The verifier is the backbone `generate`
receives, decoded with the sequential layout; the drafter is a separately trained Mask-Predict model
(`decoders/nar.py`), attached with `attach_drafter` (the tasks layer loads its checkpoint).

Algorithm.
    1. The drafter drafts every example's whole output: Mask-Predict, T iterations.
    2. Draft and verify (`decoders/drafts.py`): a verifier call feeds the row's last token and the next
       `draft_tokens` draft tokens at the row's current output index, accepts the longest prefix its
       greedy tokens agree with and appends its own token after it (1 .. draft_tokens + 1 tokens).
    3. Re-draft: where the verifier's own token differs from the draft at its index, the rest of the
       draft was conditioned on a wrong prefix, so the drafter drafts again with the verified prefix
       given (those positions fixed, the rest masked: `MaskPredictDecoder.mask_predict`), at the
       same length. Where the verified output has outgrown the draft, the drafter re-drafts too, at
       a length `draft_tokens` past the verified prefix (capped at its `max_new_tokens`; past that
       nothing is offered and the verifier goes on alone, one token per call).
With `top_k` = 1 the output is exactly sequential greedy decoding of the verifier, whatever the
drafter drafts; `top_k` > 1 is the paper's relaxed acceptance (a draft token passes if it is among
the verifier's top-k tokens there): faster, no longer exact.

Host syncs: the loop's one per verifier call, which also reads back which rows re-draft and the
shapes of their pass (`after_call`), and the drafter's own encoder and length read-back once per
decode.
Telemetry (`stats`): `aggressive_calls` counts the verifier's calls; the draft tokens offered and
accepted, the rows re-drafted and the drafter's decoder passes (first draft and re-drafts) are
reported beside them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoders import register
from datamodules.vocabulary import Range, SpecialTokens
from decoders.base import OUTPUT_BOUND, Option
from decoders.backbone import cross_attention_mask, encode
from decoders.drafts import DRAFT_LENGTH, DraftAndVerifyDecoder, Verified
from decoders.loop import send
from decoders.nar import MaskPredictDecoder, mask_predict_passes
from decoders.sequential import SequentialDecoder


@dataclass
class Drafts:
    """The drafter's state over one decode, per example (index: the example's row in the batch)."""

    encoder_states: torch.Tensor  # (B, S, d_model) the drafter's own encoder output
    encoder_mask: torch.Tensor    # (B, 1, 1, S) its cross-attention mask
    tokens: torch.Tensor          # (B, max_new_tokens) the current draft, by output index
    lengths: torch.Tensor         # (B,) how many of them are drafted
    offered: torch.Tensor         # 0-dim: draft tokens offered to the verifier so far
    accepted: torch.Tensor        # 0-dim: draft tokens it accepted
    redrafts: int = 0             # rows drafted again
    passes: int = 0               # the drafter's decoder passes


@register("aggressive")
class AggressiveDecoder(DraftAndVerifyDecoder):
    layout_family = SequentialDecoder.layout_family  # it decodes what the sequential decoder trains
    trains_nothing = True
    drafts_with = "nar"
    calls_stat = "aggressive_calls"
    # The sequential layout and loss, shared rather than copied: those of the model it verifies with
    # (tasks never fit this decoder, `trains_nothing`).
    layout = SequentialDecoder.layout
    loss = SequentialDecoder.loss

    # `drafter` is the drafter checkpoint's path, read by the tasks layer only.
    options = {"draft_tokens": Option(8, Range(ge=1, note="draft tokens verified per call"),
                                      decode_only=True),
               "drafter": Option(None, decode_only=True),
               "top_k": Option(1, Range(ge=1, note="1 = exact acceptance"), decode_only=True),
               "max_new_tokens": OUTPUT_BOUND,
               "draft_length": DRAFT_LENGTH,
               "drafter_iterations": Option(None, Range(ge=1, optional=True,
                                                        note="null: the drafter's own iterations"),
                                            decode_only=True)}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        # attached, not submodules: the drafter is its own checkpoint, never saved with this one,
        # and moving or training this decoder leaves it alone (`drafter_parts` puts it beside the
        # inputs it drafts for; it always decodes in eval mode)
        self.attached: tuple[MaskPredictDecoder, torch.nn.Module] | None = None

    def attach_drafter(self, nar_decoder: MaskPredictDecoder, nar_model: torch.nn.Module) -> None:
        """Draft with `nar_decoder` on its backbone `nar_model` (same tokenizer as the verifier's),
        decoding with `drafter_iterations` Mask-Predict iterations where set."""
        if self.drafter_iterations is not None:
            nar_decoder.iterations = int(self.drafter_iterations)
        self.attached = (nar_decoder.eval(), nar_model.eval())

    # ---- drafting ----------------------------------------------------------------------------
    @property
    def draft_width(self) -> int:
        return self.draft_tokens

    def drafter_parts(self, device: torch.device) -> tuple[MaskPredictDecoder, torch.nn.Module]:
        """The attached drafter, on `device` (moved there once, where the verifier was moved)."""
        if self.attached is None:
            raise RuntimeError("the aggressive decoder has no drafter: attach one with attach_drafter "
                               "(the tasks layer does, from decoder.drafter=NAR_CKPT)")
        nar, nar_model = self.attached
        weight = next(nar_model.parameters(), None)
        if weight is not None and weight.device != device:   # a host attribute: no sync
            self.attached = (nar.to(device), nar_model.to(device))
        return self.attached

    def begin_drafts(self, model, input_ids, attention_mask, encoder_states):
        nar, nar_model = self.drafter_parts(input_ids.device)
        nar_states = encode(nar_model, input_ids, attention_mask)
        tokens, lengths, passes = nar.predict_outputs(nar_model, nar_states, attention_mask)
        padded = tokens.new_full((len(tokens), nar.max_new_tokens), self.special.pad)
        padded[:, : tokens.size(1)] = tokens
        zero = torch.zeros((), dtype=torch.long, device=tokens.device)
        return Drafts(nar_states, cross_attention_mask(attention_mask, nar_states.dtype), padded,
                      lengths, offered=zero, accepted=zero, passes=max(passes))

    def after_call(self, state: Drafts, verified: Verified) -> torch.Tensor:
        """Count the call's verified drafts, and decide which rows need drafting again (module
        docstring): (3, live) whether a row does, its count and its draft's length, read back with
        the loop's one host sync."""
        # the call just made verified the drafts it fed (none at the first call); drafts made
        # after a row's last call are never fed, so they are counted here, when fed, not when made
        if verified.offered is not None:
            state.offered = state.offered + verified.offered.sum()
        state.accepted = state.accepted + verified.accepted.sum()
        examples, count = verified.origin.view(-1), verified.count
        lengths = state.lengths[examples]                             # (live,)
        columns = state.tokens.size(1)
        last = (count - 1).clamp(max=columns - 1)                    # the verifier's own token's index
        disagrees = (count - 1 < lengths) & (state.tokens[examples, last] != verified.next_token.view(-1))
        # rows that are done are dropped before drafting, so this need not know which those are
        needed = (disagrees | (count >= lengths)) & (count < columns)
        return torch.stack([needed.long(), count, lengths])

    def draft(self, model, state: Drafts, verified: Verified, host: list[list[int]]):
        needed, count_host, lengths_host = host
        rows = [row for row, need in enumerate(needed) if need]
        if rows:
            self.redraft(state, verified, rows, [count_host[row] for row in rows],
                         [lengths_host[row] for row in rows])
        examples, count, m = verified.origin.view(-1), verified.count, self.draft_tokens
        lengths = state.lengths[examples]                             # (live,)
        # the next call's draft: output indices count .. count + m - 1 (its first fed token, the
        # verifier's own, sits at count - 1); indices past the draft are filler, never offered
        columns = state.tokens.size(1)
        indices = (count[:, None] + torch.arange(m, device=count.device)).clamp(max=columns - 1)
        drafts = state.tokens[examples[:, None], indices]             # (live, m)
        offered = (lengths - count).clamp(0, m)
        return drafts, offered

    def redraft(self, state: Drafts, verified: Verified, rows: list[int], given: list[int],
                lengths: list[int]) -> None:
        """Draft again, with the verified prefix given, the live `rows`, whose counts are `given`
        and whose drafts have `lengths` tokens: at the same length where the draft disagrees, and
        `draft_tokens` past the prefix (capped at the drafter's length bound) where it ran out."""
        nar, nar_model = self.drafter_parts(state.tokens.device)
        columns = state.tokens.size(1)
        new_lengths = [length if prefix < length else min(columns, prefix + self.draft_tokens)
                       for prefix, length in zip(given, lengths)]
        passes = max(mask_predict_passes(length - prefix, nar.iterations)
                     for prefix, length in zip(given, new_lengths))
        width = max(new_lengths)
        device = verified.count.device
        rows_t, lengths_t = send([rows, new_lengths], device)
        redrafted = verified.origin.view(-1)[rows_t]
        given_t = verified.count[rows_t]
        positions = torch.arange(width, device=device)[None, :]
        # the verified prefix lies within the loop's columns (a row that goes on has count < bound)
        produced = verified.produced[redrafted]                       # (rows, columns of the loop)
        prefix_tokens = F.pad(produced[:, :width], (0, max(0, width - produced.size(1))))
        decoder_input = torch.where(positions < given_t[:, None], prefix_tokens,
                                    torch.where(positions < lengths_t[:, None], self.special.mask,
                                                self.special.pad))
        tokens, _ = nar.mask_predict(nar_model, decoder_input, lengths_t, given_t, passes,
                                     state.encoder_states[redrafted], state.encoder_mask[redrafted])
        state.tokens[redrafted, :width] = tokens
        state.lengths[redrafted] = lengths_t
        state.redrafts += len(rows)
        state.passes += passes

    def draft_counters(self, state: Drafts) -> dict[str, torch.Tensor]:
        device = state.offered.device
        return {"draft_tokens_offered": state.offered, "draft_tokens_accepted": state.accepted,
                "redrafts": torch.tensor(state.redrafts, device=device),
                "drafter_passes": torch.tensor(state.passes, device=device)}
