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
    no draft, and the call yields one token, as sequential decoding does. The lookup runs on the
    host: a table made once per decode, from each window of `match` source tokens to the tokens
    after its latest occurrence, read with the row's newest tokens, which the loop's one sync per
    call reads anyway. A row without a draft so costs the device nothing, and a call where no row
    has one is a sequential decoder call. (IAD drafts the whole rest of the input and re-aligns
    after a mismatch; here the draft is bounded and re-aligned at every call, as prompt lookup
    does.)
Verify. Draft and verify (decoders/drafts.py): feed [y, d_1, .., d_m] (m = `draft_tokens`, the
    tokens past a row's offered ones are never accepted), keep the longest prefix of the draft on
    which the model's argmax agrees, then the model's own next token: 1 .. offered + 1 tokens per
    call, and the output is exactly greedy decoding of the model. Batching, the cache and host
    syncs: drafts.py; the source is read to the host once per decode, and drafts stay on the host
    (`Draft.on_host`): a call's fed columns go to the device in one copy, only when some row feeds a
    draft, and a draft that is only probed is checked there.
Measured (`min_acceptance` null, the default). A row's drafts are a function of its source and its
    output so far, so a decode need not run the verify loop to tally them: where the measured rule
    would feed no draft at the decode's start, or where sequential decoding was measured faster
    per output token (`draft_policy.LoopChoice`), the decode is sequential decoding, its loop's
    host work per call less than the verify loop's, and the drafts the verify loop would have
    probed are probed on its output afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders import register
from datamodules.vocabulary import Range
from decoders.base import OUTPUT_BOUND, Option
from decoders.draft_policy import DRAFT_LENGTH, MEASURED_MIN_ACCEPTANCE
from decoders.drafts import Draft, DraftAndVerifyDecoder, Drafting, HostReads, HostRows, Source, Verified
from decoders.loop import read_back
from decoders.sequential import SequentialDecoder


@dataclass
class SourceLookup:
    """Every example's source laid out for the lookup on the host, made once per decode."""

    sources: list[list[int]]   # per example: its real source tokens
    # per example: each window of `match` real source tokens that some real token follows -> where
    # the tokens after its latest occurrence start in `sources`
    continuations: list[dict[tuple[int, ...], int]]

    def following(self, example: int, window: tuple[int, ...], most: int) -> list[int]:
        """Up to `most` source tokens after the latest occurrence of `window` in the example's
        source (none where it does not occur, followed by a token)."""
        start = self.continuations[example].get(window)
        return [] if start is None else self.sources[example][start: start + most]


def source_lookup(input_ids: torch.Tensor, attention_mask: torch.Tensor, match: int) -> SourceLookup:
    """The batch's sources (B, S) laid out for the lookup of `match` output tokens: the decode's
    one read of its sources to the host (a host sync once per decode)."""
    sources, continuations = [], []
    for row, mask in zip(*read_back(input_ids, attention_mask)):
        real = [token for token, visible in zip(row, mask) if visible]
        windows = zip(*(real[i: len(real) - match + i] for i in range(match)))   # those a token follows
        # built by `dict` itself, not a Python loop: it is on every decode's critical path; later
        # windows overwrite earlier ones, so each keeps its latest occurrence
        sources.append(real)
        continuations.append(dict(zip(windows, range(match, len(real)))))
    return SourceLookup(sources, continuations)


@register("lookup")
class LookupDecoder(DraftAndVerifyDecoder[SourceLookup]):
    layout_family = SequentialDecoder.layout_family  # it decodes what the sequential decoder trains
    trains_nothing = True
    options = {"draft_tokens": Option(4, Range(ge=1, note="source tokens offered per call"),
                                      decode_only=True),
               "match": Option(1, Range(ge=1, note="output tokens looked up in the source"),
                               decode_only=True),
               "max_new_tokens": OUTPUT_BOUND,
               "draft_length": DRAFT_LENGTH,
               "min_acceptance": MEASURED_MIN_ACCEPTANCE}

    # The sequential layout and loss, shared rather than copied: those of the model it decodes
    # (tasks never fit this decoder, `trains_nothing`; a test may train a model with them).
    layout = SequentialDecoder.layout
    loss = SequentialDecoder.loss

    # ---- generation: draft and verify, the source drafts ----------------------------------------
    @property
    def draft_width(self) -> int:
        return self.draft_tokens

    @property
    def host_reads(self) -> HostReads:
        """It drafts on the host from each row's newest token and the `match` - 1 before it."""
        return HostReads(earlier_tokens=self.match - 1)

    def begin_drafts(self, model, source: Source) -> Drafting:
        lookup = source_lookup(source.input_ids, source.attention_mask, self.match)
        return Drafting(lookup, Draft.nothing(len(lookup.sources)))

    def draft(self, model, state: SourceLookup, verified: Verified, host: HostRows) -> Draft:
        drafts = [state.following(example, (*earlier, token), self.draft_tokens)
                  for example, earlier, token in zip(host.examples, host.earlier, host.newest)]
        return Draft(None, [len(tokens) for tokens in drafts], on_host=drafts)

    def verifies(self, record, rows):
        # sequential decoding also where the measured rule would feed no draft at the start
        return record.may_feed(rows, self.draft_width) and record.loops.verifies(rows)

    def probe_output(self, record, input_ids, attention_mask, outputs):
        prior = record.prior()
        probes = self.probes(source_lookup(input_ids, attention_mask, self.match), outputs)
        record.add(prior.added([0] * len(probes), [0] * len(probes), probes), prior)

    def probes(self, lookup: SourceLookup, outputs: list[list[int]]) -> list[bool]:
        """For each draft a decode that fed none would have probed (a draft after an output token
        that another follows), whether its first token is that next one."""
        n, probes = self.match, []
        for example, tokens in enumerate(outputs):
            for newest in range(n - 1, len(tokens) - 1):
                draft = lookup.following(example, tuple(tokens[newest - n + 1: newest + 1]), 1)
                if draft:
                    probes.append(draft[0] == tokens[newest + 1])
        return probes
