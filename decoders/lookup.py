"""Lookup decoding: drafts copied from the source, verified by the model in one call.

Reference: Ge, Xia, Sun, Chen & Wei 2022, "Lossless Acceleration for Seq2seq Generation with
Aggressive Decoding" (arXiv:2205.10350), Input-guided Aggressive Decoding (IAD): where an output
copies much of its input, spans of the input are good guesses of what comes next, and checking them
against the model's own greedy tokens in one parallel pass keeps the output exactly greedy.
transformers offers the n-gram form of it as prompt lookup (`prompt_lookup_num_tokens`).

Model. Any model the sequential decoder decodes: the sequential layout and layout family. It adds no
    module and trains nothing (`trains_nothing`): it decodes a trained sequential model as it is.
Draft. After each call, a row looks up its last `match` output tokens (the model's newest token
    included) in its own source, real tokens only. Its draft is the up to `draft_tokens` source
    tokens that follow their latest occurrence among those followed by at least one source token,
    cut at the source's last real token. No such occurrence, or fewer than `match` tokens produced:
    no draft, and the call yields one token, as sequential decoding does. With `match` 1 (the
    default) a table made once per decode, from each token id to its latest window, makes the
    lookup one read per call. (IAD drafts the whole rest of the input and re-aligns after a
    mismatch; here the draft is bounded and re-aligned at every call, as prompt lookup does.)
Verify. Draft and verify (decoders/drafts.py): feed [y, d_1, .., d_m] (m = `draft_tokens`, the
    tokens past a row's offered ones are never accepted), keep the longest prefix of the draft on
    which the model's argmax agrees, then the model's own next token: 1 .. offered + 1 tokens per
    call, and the output is exactly greedy decoding of the model. Batching, the cache and host
    syncs: drafts.py; the lookup itself is tensor code over the whole batch, with no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders import register
from datamodules.vocabulary import Range
from decoders.base import OUTPUT_BOUND, Option
from decoders.drafts import DRAFT_LENGTH, Draft, DraftAndVerifyDecoder, Source, Verified
from decoders.loop import NOT_PRODUCED
from decoders.sequential import SequentialDecoder


@dataclass
class SourceLookup:
    """Every example's source laid out for the lookup, made once per decode. Window j of a row is
    its source tokens j .. j + match - 1, its continuation the m tokens after them."""

    windows: torch.Tensor        # (B, S, match) tokens of each window; NOT_PRODUCED in every window
                                 # that is not wholly real or is followed by no real token
    continuations: torch.Tensor  # (B, 1 + S, m) the tokens after window j at entry 1 + j (padding
                                 # past the source); entry 0 is what a row without a hit reads
    offered: torch.Tensor        # (B, 1 + S) how many of those are real source tokens (0..m); entry 0
                                 # offers none
    window_entry: torch.Tensor   # (S,) 1..S: each window's entry
    last_offsets: torch.Tensor   # (match,) -match..-1: output indices of the last tokens, from a count
    # With match 1: (B, V) the entry of each token id's latest usable window (0: none), so that a
    # call reads its rows' entries in one index instead of comparing every window; None otherwise
    token_entry: torch.Tensor | None


@register("lookup")
class LookupDecoder(DraftAndVerifyDecoder[SourceLookup]):
    layout_family = SequentialDecoder.layout_family  # it decodes what the sequential decoder trains
    trains_nothing = True
    calls_stat = "lookup_calls"
    options = {"draft_tokens": Option(4, Range(ge=1, note="source tokens offered per call"),
                                      decode_only=True),
               "match": Option(1, Range(ge=1, note="output tokens looked up in the source"),
                               decode_only=True),
               "max_new_tokens": OUTPUT_BOUND,
               "draft_length": DRAFT_LENGTH}

    # The sequential layout and loss, shared rather than copied: those of the model it decodes
    # (tasks never fit this decoder, `trains_nothing`; a test may train a model with them).
    layout = SequentialDecoder.layout
    loss = SequentialDecoder.loss

    # ---- generation: draft and verify, the source drafts ----------------------------------------
    @property
    def draft_width(self) -> int:
        return self.draft_tokens

    def begin_drafts(self, model, source: Source) -> SourceLookup:
        m, n = self.draft_tokens, self.match
        input_ids, attention_mask = source.input_ids, source.attention_mask
        sources = input_ids.size(1)                                          # S
        # past the source, n + m padding slots (never real): every window has m tokens after it,
        # and one more continuation, past the source, offers none: it moves to entry 0
        tail = (input_ids.size(0), n + m)
        padded = torch.cat([input_ids, input_ids.new_full(tail, self.special.pad)], dim=1)  # (B, S + n + m)
        real = torch.cat([attention_mask.bool(), attention_mask.new_zeros(tail, dtype=torch.bool)],
                         dim=1)                                              # (B, S + n + m)
        continuations = padded[:, n:].unfold(1, m, 1)                        # (B, S + 1, m)
        # the leading real tokens of each continuation: what a draft from there may offer
        offered = real[:, n:].unfold(1, m, 1).long().cummin(dim=2).values.sum(dim=2)   # (B, S + 1)
        windows = padded[:, : sources + n - 1].unfold(1, n, 1)              # (B, S, n)
        usable = real[:, : sources + n - 1].unfold(1, n, 1).all(dim=2) & (offered[:, :sources] > 0)
        device = input_ids.device
        window_entry = torch.arange(1, sources + 1, device=device)
        token_entry = None
        if n == 1:
            vocabulary = model.get_input_embeddings().num_embeddings   # every source and output id
            entries = torch.where(usable, window_entry, 0)                     # (B, S)
            token_entry = entries.new_zeros(input_ids.size(0), vocabulary).scatter_reduce_(
                1, input_ids, entries, "amax")                                 # (B, V)
        # an unusable window never equals produced tokens (all >= 0)
        windows = torch.where(usable[..., None], windows, NOT_PRODUCED)
        return SourceLookup(windows, continuations.roll(1, dims=1), offered.roll(1, dims=1),
                            window_entry, torch.arange(-n, 0, device=device), token_entry)

    def draft(self, model, state: SourceLookup, verified: Verified, host) -> Draft:
        example = verified.example                                          # (live,)
        if state.token_entry is not None:   # match 1: the newest token's latest window, one read
            latest = state.token_entry[example, verified.next_token.view(-1)]  # (live,)
            return Draft(state.continuations[example, latest], state.offered[example, latest])
        # each row's last `match` output tokens, the model's newest one last (a row that has
        # produced fewer reads a negative index, and is masked below)
        last_indices = verified.count + state.last_offsets                   # (live, match)
        last = verified.produced[verified.origin, last_indices]              # (live, match)
        hits = (state.windows[example] == last[:, None]).all(dim=2)          # (live, S)
        if self.match > 1:  # a row that has produced fewer tokens has none to look up yet
            hits &= verified.count >= self.match
        # the latest hit's entry; none reads entry 0, which offers nothing
        latest = (hits * state.window_entry).amax(dim=1)                     # (live,)
        return Draft(state.continuations[example, latest], state.offered[example, latest])  # (live, m), (live,)
