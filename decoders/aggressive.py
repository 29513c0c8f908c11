"""Aggressive decoding: a non-autoregressive model drafts the output, the autoregressive model verifies.

Reference: Ge, Xia, Sun, Chen, Wei 2022, "Lossless Acceleration for Seq2seq Generation with
Aggressive Decoding" (Generalized Aggressive Decoding, GAD). The verifier is the backbone `generate`
receives, decoded with the sequential layout; the drafter is a separately trained Mask-Predict model
(`decoders/nar.py`), attached with `attach_drafter` (the tasks layer loads its checkpoint). A drafter
trained from the verifier's checkpoint with its encoder frozen (`nar`'s `freeze_encoder`) shares the
verifier's encoder: it drafts from the verifier's encoder states, and no second encoder runs.

Algorithm.
    1. The drafter drafts every example's whole output: Mask-Predict, T iterations. The verifier's
       first call checks its first `draft_tokens` tokens beside the start token (`begin_drafts`).
    2. Draft and verify (`decoders/drafts.py`): a verifier call feeds the row's last token and the next
       `draft_tokens` draft tokens at the row's current output index, accepts the longest prefix its
       greedy tokens agree with and appends its own token after it (1 .. draft_tokens + 1 tokens).
    3. Re-draft: where the verifier's own token differs from the draft at its index, the rest of the
       draft was conditioned on a wrong prefix, so the drafter drafts again with the verified prefix
       given (those positions fixed, the rest masked: `MaskPredictDecoder.mask_predict`), at the
       same length. Where the verified output has outgrown the draft, the drafter re-drafts too, at
       a length `draft_tokens` past the verified prefix (capped at its `max_new_tokens`; past that
       nothing is offered and the verifier goes on alone, one token per call).
       With `redraft` = "outgrown" a rejected draft is not drafted again: its later tokens are
       offered as they are (right wherever the drafter only got a token wrong, not the length of
       what precedes), and only a draft the output has outgrown is. With `redraft` = "never" the
       drafter drafts once per decode: past its draft's end a row's verifier goes on alone. With
       "realign" it drafts once too, and a rejected draft is re-aligned instead, on the host: the
       verifier's own token is looked up in the draft within `draft_tokens` places of its index,
       and the draft goes on after the nearest occurrence (a word the drafter left in or out no
       longer shifts the rest), as Ge et al.'s input-guided drafts re-align with their input. Each
       trades verifier calls for drafter passes; the paper's rule ("mismatch") is the default.
With `top_k` = 1 the output is exactly sequential greedy decoding of the verifier, whatever the
drafter drafts; `top_k` > 1 is the paper's relaxed acceptance (a draft token passes if it is among
the verifier's top-k tokens there): faster, no longer exact.

Host syncs: the loop's one per verifier call, which under the paper's rule also reads back which
rows' drafts disagree with the verifier (`host_reads`; the rest of the re-draft decision and the
shapes of its pass follow from host values); once per decode, the drafter's own encoder's (unless it
shares the verifier's) and its predicted lengths (the shapes of its first pass, and the first call's
offers; a drafter with several length candidates reads its chosen ones back once more); with
"realign", its draft's tokens, which then stay on the host.
Telemetry (`stats`): beside the verify loop's counters (draft tokens offered and accepted, ...),
the drafter's own (`DrafterCounters`): the rows re-drafted, its decoder passes and the seconds it
took (first draft and re-drafts, `drafter_seconds`: the rest of a decode's time is the verifier's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoders import register
from datamodules.vocabulary import Choice, Range, SpecialTokens
from decoders.base import OUTPUT_BOUND, Option
from decoders.backbone import cross_attention_mask, encode, same_encoder
from decoders.draft_policy import ALWAYS_MIN_ACCEPTANCE, DRAFT_LENGTH
from decoders.drafts import (Draft, DraftAndVerifyDecoder, Drafting, HostReads, HostRows, Source,
                             Verified)
from decoders.loop import Stopwatch, read_back, send
from decoders.nar import MaskPredictDecoder, mask_predict_passes
from decoders.sequential import SequentialDecoder


# When the drafter drafts again (the option `redraft`): wherever the verifier rejects a draft token,
# as Ge et al. do, only where the verified output has outgrown the draft, or never (one draft per
# decode: a pass of the drafter costs more than the verifier calls a short re-draft saves), a
# rejected draft offered as it is or re-aligned with the verifier's token (module docstring).
MISMATCH, OUTGROWN, NEVER, REALIGN = "mismatch", "outgrown", "never", "realign"


@dataclass
class DrafterCounters:
    """The drafter's work over a decode, reported in `stats` beside the loop's counters."""

    redrafts: int = 0                 # rows drafted again
    drafter_passes: int = 0           # its decoder passes
    drafter_seconds: Stopwatch | None = None   # its first draft and re-drafts (set per decode)


@dataclass
class Drafts:
    """The drafter's state over one decode, per example (index: the example's row in the batch)."""

    encoder_states: torch.Tensor  # (B, S, d_model) the drafter's encoder output (the verifier's
                                  # where they share the encoder)
    encoder_mask: torch.Tensor    # (B, 1, 1, S) its cross-attention mask
    tokens: torch.Tensor          # (B, max_new_tokens) the current draft, by output index
    lengths: list[int]            # host: how many of them are drafted
    offsets: torch.Tensor         # (m,) 0..m-1 a draft's output indices past a row's count, and
                                  # m under the paper's rule: the token the loop compares past them
    counters: DrafterCounters
    # `realign` only (else None), on the host: each example's draft, and how far its draft index
    # lies past its output index (changed where a rejected draft is re-aligned)
    host_tokens: list[list[int]] | None = None
    shifts: list[int] | None = None


@dataclass
class AttachedDrafter:
    """The drafter `attach_drafter` attached: a nar decoder and its backbone."""

    decoder: MaskPredictDecoder
    model: torch.nn.Module
    shares_encoder: bool   # its encoder is the verifier's (`same_encoder`) when attached

    def encoding(self, source: Source) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, d_model) its encoder's output for `source` and its (B, 1, 1, S) cross-attention
        mask: the verifier's, where it shares that encoder and its weights take them as they are
        (one dtype, or autocast casting both; a verifier cast to another dtype after attaching is
        not), else its own encoder's."""
        states = source.encoder_states
        if self.shares_encoder and (states.dtype == next(self.model.parameters()).dtype
                                    or torch.is_autocast_enabled(states.device.type)):
            own = states
        else:
            own = encode(self.model, source.input_ids, source.attention_mask)
        if source.cross_mask is not None and source.cross_mask.dtype == own.dtype:
            return own, source.cross_mask
        return own, cross_attention_mask(source.attention_mask, own.dtype)


@register("aggressive")
class AggressiveDecoder(DraftAndVerifyDecoder[Drafts]):
    layout_family = SequentialDecoder.layout_family  # it decodes what the sequential decoder trains
    trains_nothing = True
    drafts_with = "nar"
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
               "min_acceptance": ALWAYS_MIN_ACCEPTANCE,
               "drafter_iterations": Option(None, Range(ge=1, optional=True,
                                                        note="null: the drafter's own iterations"),
                                            decode_only=True),
               "redraft": Option(MISMATCH, Choice((MISMATCH, OUTGROWN, NEVER, REALIGN)), decode_only=True)}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        # attached, not submodules: the drafter is its own checkpoint, never saved with this one,
        # and moving or training this decoder leaves it alone (`drafter_on` puts it beside the
        # inputs it drafts for; it always decodes in eval mode)
        self.attached: AttachedDrafter | None = None

    def attach_drafter(self, nar_decoder: MaskPredictDecoder, nar_model: torch.nn.Module,
                       verifier: torch.nn.Module | None = None) -> None:
        """Draft with `nar_decoder` on its backbone `nar_model` (same tokenizer as the verifier's),
        decoding with `drafter_iterations` Mask-Predict iterations where set. Where `verifier`, the
        backbone it will draft for, has the drafter's encoder (`backbone.same_encoder`: a nar
        checkpoint trained from the verifier's with nar's option `freeze_encoder`), drafts read
        the verifier's encoder states and the drafter's encoder never runs."""
        if self.drafter_iterations is not None:
            nar_decoder.iterations = int(self.drafter_iterations)
        shares = verifier is not None and same_encoder(nar_model, verifier)
        self.attached = AttachedDrafter(nar_decoder.eval(), nar_model.eval(), shares)

    # ---- drafting ----------------------------------------------------------------------------
    @property
    def draft_width(self) -> int:
        return self.draft_tokens

    def drafter_on(self, device: torch.device) -> AttachedDrafter:
        """The attached drafter, on `device` (moved there once, where the verifier was moved)."""
        if self.attached is None:
            raise RuntimeError("the aggressive decoder has no drafter: attach one with attach_drafter "
                               "(the tasks layer does, from decoder.drafter=NAR_CKPT)")
        attached = self.attached
        weight = next(attached.model.parameters(), None)
        if weight is not None and weight.device != device:   # a host attribute: no sync
            attached.decoder.to(device)
            attached.model.to(device)
        return attached

    @property
    def host_reads(self) -> HostReads:
        """It drafts after each call's sync; under the paper's rule it reads there which rows'
        drafts disagree with the verifier's own token (the rest of a re-draft decision follows from
        the counts the loop reads anyway)."""
        return HostReads(disagreement=self.redraft == MISMATCH)

    def begin_drafts(self, model, source: Source) -> Drafting:
        """The drafter drafts every example's whole output; the first call verifies its first
        `draft_tokens` beside the start token (a draft shorter than that offers its length)."""
        device = source.input_ids.device
        drafter = self.drafter_on(device)
        nar = drafter.decoder
        clock = Stopwatch(device)
        with clock.timing():
            nar_states, nar_mask = drafter.encoding(source)
            predicted = nar.predict_outputs(drafter.model, nar_states, source.attention_mask, nar_mask)
            tokens = predicted.tokens
            padded = tokens.new_full((len(tokens), nar.max_new_tokens), self.special.pad)
            padded[:, : tokens.size(1)] = tokens
            # on the host: the first call's offers, and every later re-draft decision but the
            # paper's, made there; read back once more only where several length candidates were
            # drafted (the drafter read back all of theirs, not which one each example chose)
            host_lengths = (predicted.host_lengths if predicted.host_lengths is not None
                            else predicted.lengths.tolist())
        counters = DrafterCounters(drafter_passes=max(predicted.passes), drafter_seconds=clock)
        offsets = torch.arange(self.draft_tokens + (self.redraft == MISMATCH), device=device)
        state = Drafts(nar_states, nar_mask, padded, host_lengths, offsets, counters)
        if self.redraft == REALIGN:   # the draft's one read-back: it is re-aligned on the host
            drafted, = read_back(tokens)
            state.host_tokens = [row[:length] for row, length in zip(drafted, host_lengths)]
            state.shifts = [0] * len(host_lengths)
        first = Draft(padded[:, offsets.clamp(max=padded.size(1) - 1)],
                      offered=[min(length, self.draft_tokens) for length in host_lengths])
        return Drafting(state, first, counters)

    def draft(self, model, state: Drafts, verified: Verified, host: HostRows) -> Draft:
        if self.redraft == REALIGN:
            return self.realigned(state, host)
        counts, columns, disagrees = host.counts, state.tokens.size(1), host.disagrees
        lengths = [state.lengths[example] for example in host.examples]
        # drafted again (module docstring): an output that reached its draft's length unless the
        # rule is never, one whose draft disagrees under the paper's; never one at the drafter's bound
        outgrowing = self.redraft != NEVER
        rows = [row for row, (count, length) in enumerate(zip(counts, lengths))
                if count < columns and ((outgrowing and count >= length) or disagrees[row])]
        if rows:
            with state.counters.drafter_seconds.timing():
                redrafted = self.draft_again(state, verified, rows, [counts[row] for row in rows],
                                             [lengths[row] for row in rows])
            for row, length in zip(rows, redrafted):
                lengths[row] = state.lengths[host.examples[row]] = length
        m = self.draft_tokens
        # the next call's draft: output indices count .. count + m - 1 (its first fed token, the
        # verifier's own, sits at count - 1); indices past the draft are filler, never offered
        indices = (verified.count + state.offsets).clamp(max=columns - 1)    # (live, m or m + 1)
        return Draft(state.tokens[verified.origin, indices],
                     offered=[min(max(length - count, 0), m) for length, count in zip(lengths, counts)])

    def realigned(self, state: Drafts, host: HostRows) -> Draft:
        """`realign`'s drafts, on the host: each row's draft after the place that holds its newest
        token, the verifier's own. That is its index plus the example's shift while the draft agrees
        there; where it does not, the nearest place within `draft_tokens` of it that holds the
        token (the earlier of two as near), which moves the shift; where none does, the draft goes
        on as it is."""
        m, drafts = self.draft_tokens, []
        for example, token, count in zip(host.examples, host.newest, host.counts):
            draft, aligned = state.host_tokens[example], count - 1 + state.shifts[example]
            at = aligned
            if not (0 <= aligned < len(draft) and draft[aligned] == token):
                near = [j for j in range(max(0, aligned - m), min(len(draft), aligned + m + 1))
                        if draft[j] == token]
                if near:
                    at = min(near, key=lambda j: abs(j - aligned))
                    state.shifts[example] += at - aligned
            drafts.append(draft[at + 1: at + 1 + m])
        return Draft(None, [len(tokens) for tokens in drafts], on_host=drafts)

    def draft_again(self, state: Drafts, verified: Verified, rows: list[int], given: list[int],
                    lengths: list[int]) -> list[int]:
        """Draft again, with the verified prefix given, the live `rows`, whose counts are `given`
        and whose drafts have `lengths` tokens: at the same length where the draft disagrees, and
        `draft_tokens` past the prefix (capped at the drafter's length bound) where it ran out.
        Returns the rows' new draft lengths."""
        drafter = self.drafter_on(state.tokens.device)
        nar = drafter.decoder
        columns = state.tokens.size(1)
        new_lengths = [length if prefix < length else min(columns, prefix + self.draft_tokens)
                       for prefix, length in zip(given, lengths)]
        passes = max(mask_predict_passes(length - prefix, nar.iterations)
                     for prefix, length in zip(given, new_lengths))
        width = max(new_lengths)
        device = verified.count.device
        rows_t, lengths_t = send([rows, new_lengths], device)
        redrafted = verified.example[rows_t]
        given_t = verified.count[rows_t, 0]
        positions = torch.arange(width, device=device)[None, :]
        # the verified prefix lies within the loop's columns (a row that goes on has count < bound)
        produced = verified.produced[redrafted]                       # (rows, columns of the loop)
        prefix_tokens = F.pad(produced[:, :width], (0, max(0, width - produced.size(1))))
        decoder_input = torch.where(positions < given_t[:, None], prefix_tokens,
                                    torch.where(positions < lengths_t[:, None], self.special.mask,
                                                self.special.pad))
        tokens, _ = nar.mask_predict(drafter.model, decoder_input, lengths_t, given_t, passes,
                                     state.encoder_states[redrafted], state.encoder_mask[redrafted],
                                     confidences=False)
        state.tokens[redrafted, :width] = tokens
        state.counters.redrafts += len(rows)
        state.counters.drafter_passes += passes
        return new_lengths
