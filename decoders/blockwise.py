"""Blockwise parallel decoding: k-1 proposal heads guess ahead, the base head verifies in one pass.

Reference: Stern, Shazeer & Uszkoreit 2018, "Blockwise Parallel Decoding for Deep Autoregressive
Models" (NeurIPS). Notation: k = `block_size`; the base head p_1 is T5's own output head; proposal
head p_i (i = 2..k) predicts token t+i from the decoder state at t.

Layout. The sequential layout (`SequentialDecoder.layout`: s_1 <sep> ... s_m </s>), so the base head
    trains exactly as the sequential decoder's and `sequential` can decode a blockwise checkpoint.
Heads. p_i = output_logits(h + W2 relu(W1 h)) (d_model -> d_ff -> d_model, the backbone's shared
    output projection). W2 starts at zero, so every head starts as a copy of the base head (it
    proposes the base head's next token again) and learns only the difference.
Loss. Sum of the k cross-entropies: base head on the labels, head i on the labels shifted left by
    i-1 more (ignoring -100). `freeze_backbone`: the backbone (output projection included) runs under
    no_grad / with detached weights and only the heads learn (the paper's frozen-backbone setting).
Decode (Section 3, with the paper's combined scoring and proposal: one decoder call per iteration).
    Feed the block [y_t, q_{t+1}, .., q_{t+k-1}] (last accepted token, k-1 proposals). The base head's
    argmax at fed position j is the greedy token after it, so accept the longest prefix of proposals
    on which it agrees (`accepted_length`), then append the base head's own token after the last
    accepted position; the heads at that same position give the next block's proposals. Every
    iteration yields 1..k tokens and the output is exactly sequential greedy decoding of the base
    head. `top_k` > 1 is the paper's approximate acceptance (Section 5): a proposal passes if it is
    among the base head's top-k tokens there (faster, no longer exact).
    Generation stops at the end token (later tokens of the block are discarded) or at
    `max_new_tokens`.

Batching. Rows accept different lengths, so the key/value cache cannot be cropped per row; it is kept
    compact instead. Before a call, row r's self-attention slots 0..n_r-1 hold its start token and
    first n_r - 1 output tokens at their own positions (n_r = tokens it has produced; its last token
    is fed next, at position n_r), and its slots n_r..K-1 are padding (K = max over live rows of n_r).
    The call appends the k fed tokens (positions n_r..n_r+k-1) after slot K-1. The self-attention
    bias is T5's relative bias of query position - key position, gathered from a table made once per
    generate, plus a mask: visible iff the key is not in the query's future (padding slots are
    given a far-future position, so this hides them too); `run_decoder` adds it in every layer.
    After the call each row's accepted fed slots are gathered down to follow its own slots
    (`block_after_own_slots`, `base.gather_self_attention_cache`) and the cache is cropped to the
    new batch maximum.
    Cache bound: between calls the self-attention cache holds exactly max over live rows of n_r
    slots (tokens produced), during a call k more. No rejected proposal stays in it; a row's only
    waste is its max(n) - n_r padding slots, how far the longest live row is ahead of it. Finished
    rows leave the batch and the cache; the cross-attention cache is otherwise never touched.
Host syncs. One per decoder call: `LiveRows.read` reads back which rows ended at e together with
    every row's new n_r, from which the host drops the finished rows and sets the next call's cache
    width (skipped on a call after which every live row is at `max_new_tokens` anyway). Everything
    else per call is tensor ops (the tokens each row produced, `block_output`, go to a per-example
    buffer through the rows' original indices); the results are read back once, at the end.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from decoders import register
from datamodules.vocabulary import Range, SpecialTokens
from decoders.backbone import (at_least_float32, cross_attention_mask, encode,
                               gather_self_attention_cache, new_cache, output_logits,
                               past_distance_bias_table, run_decoder)
from decoders.base import DecodeOutput, Decoder
from decoders.loop import LiveRows, NOT_PRODUCED, split_flat_output
from decoders.sequential import SequentialDecoder


class ProposalHead(nn.Module):
    """h + W2 relu(W1 h): one residual feed-forward layer on the decoder's final hidden state."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        # Zero W2: the head starts as an exact copy of the base head's input, so training begins
        # from the base head's predictions instead of noise. W1 still gets gradients after the
        # first step (through W2), as in a residual adapter.
        nn.init.zeros_(self.w2.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.w2(torch.relu(self.w1(hidden)))


def accepted_length(proposals: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """How many leading proposals the base head accepts.

    proposals: (B, m) the fed proposal tokens; candidates: (B, m, top_k) the base head's top-k tokens
    at the fed position *before* each proposal (top_k = 1: its argmax, exact acceptance).
    Returns (B,) longs in 0..m: the length of the longest prefix whose every token is a candidate.
    """
    match = (proposals[..., None] == candidates).any(-1)          # (B, m)
    return match.long().cumprod(dim=1).sum(dim=1)


def block_output(proposals: torch.Tensor, accepted: torch.Tensor, base_next: torch.Tensor,
                 end: int, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens one call produces for each row, and whether the row ended at `end`.

    proposals: (B, m) the fed proposals; accepted: (B,) how many of them were accepted (0..m);
    base_next: (B,) the base head's own token after the last accepted one; room: (B,) >= 1 tokens
    left before max_new_tokens. Per row: the `accepted` leading proposals, then `base_next`, cut just
    after the first end token (what follows an end token is never output) and to `room` tokens.
    Returns (B, m + 1) tokens, left-aligned, NOT_PRODUCED after the row's last one; and (B,) bool.
    """
    offset = torch.arange(proposals.size(1) + 1, device=proposals.device)          # (m + 1,)
    # base_next at position `accepted`; what lies past it is not kept
    tokens = torch.cat([proposals, base_next[:, None]], dim=1).scatter_(
        1, accepted[:, None], base_next[:, None])                                   # (B, m + 1)
    is_end = tokens == end                                                          # (B, m + 1)
    no_earlier_end = is_end.cumsum(dim=1) <= is_end                                 # (B, m + 1)
    kept = (offset < torch.minimum(accepted + 1, room)[:, None]) & no_earlier_end
    return tokens.masked_fill(~kept, NOT_PRODUCED), (kept & is_end).any(dim=1)


def block_after_own_slots(own: torch.Tensor, cached: int, length: int, width: int) -> torch.Tensor:
    """(live, width) cache slot each row keeps, in order, for `gather_self_attention_cache`.

    Before: row r's first own[r] self-attention slots are its own (padding up to slot `cached`),
    then come the slots of the block this call appended (the cache is `length` long). After: its
    slot s is its old slot s for s < own[r] and block slot s - own[r] after that, so its accepted
    block slots follow its own; slots past them are padding (copies, hidden by the next calls'
    bias). own: (live,) longs; cached, length, width: host ints (width >= every row's new count).
    """
    slot = torch.arange(width, device=own.device)                        # (width,)
    source = torch.where(slot < own[:, None], slot, cached + slot - own[:, None])
    return source.clamp(max=length - 1)                                  # past the block: padding


@register("blockwise")
class BlockwiseDecoder(Decoder):
    layout_family = "flat-causal"  # the base head trains on the sequential layout
    # Generation-only options: a trained model decodes with any value of these. (block_size fixes
    # the number of trained heads and freeze_backbone only affects training, so neither is here.)
    decode_options = ("top_k", "max_new_tokens")
    # Stern et al. add the heads to a trained model; with the backbone frozen the output is its own.
    builds_on_sequential = True

    # The sequential layout, shared rather than copied: labels = s_1 <sep> ... s_m </s>.
    layout = SequentialDecoder.layout

    option_ranges = {"block_size": Range(ge=2, note="the base head plus at least one proposal head"),
                     "top_k": Range(ge=1, note="1 = exact acceptance"), "max_new_tokens": Range(ge=1)}

    def __init__(self, backbone_config, special: SpecialTokens, block_size: int = 4,
                 freeze_backbone: bool = False, top_k: int = 1, max_new_tokens: int = 128):
        super().__init__(backbone_config, special, block_size=block_size, top_k=top_k,
                         max_new_tokens=max_new_tokens)
        self.block_size = int(block_size)
        self.freeze_backbone = bool(freeze_backbone)
        self.top_k = int(top_k)
        self.max_new_tokens = int(max_new_tokens)
        # heads[i] predicts token t + 2 + i from the decoder state at t
        self.heads = nn.ModuleList(ProposalHead(backbone_config.d_model, backbone_config.d_ff)
                                   for _ in range(self.block_size - 1))

    # ---- heads -------------------------------------------------------------------------------
    def proposal_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d_model) decoder states -> (..., k-1, vocab) logits of tokens t+2..t+k."""
        return torch.stack([output_logits(model, head(hidden)) for head in self.heads], dim=-2)

    # ---- training ----------------------------------------------------------------------------
    def trains_backbone(self) -> bool:
        return not self.freeze_backbone

    def loss(self, model, input_ids, attention_mask, layout):
        labels = layout["labels"]                                    # (B, T); -100 = ignored
        train_backbone = torch.is_grad_enabled() and not self.freeze_backbone
        with torch.set_grad_enabled(train_backbone):
            encoder_states = encode(model, input_ids, attention_mask)  # (B, S, d_model)
            hidden = model.decoder(input_ids=model._shift_right(labels),
                                   encoder_hidden_states=encoder_states,
                                   encoder_attention_mask=attention_mask).last_hidden_state  # (B, T, d)
            total = _cross_entropy(output_logits(model, hidden), labels)
        # With a frozen backbone the shared output projection must not learn through the heads
        # either: project with its weights detached (same computation as `output_logits`).
        projection = model if not self.freeze_backbone else _detached_projection(model)
        for i, head in enumerate(self.heads, start=1):
            # head i at position t predicts labels[t + i] (base head: labels[t])
            shifted = labels[:, i:]                                  # (B, T - i)
            valid = shifted != -100
            states = hidden[:, : shifted.size(1)][valid]             # (N, d_model): only scored positions
            total = total + _cross_entropy(output_logits(projection, head(states)), shifted[valid])
        return total

    # ---- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        k, end, bound = self.block_size, self.special.eos, self.max_new_tokens
        batch_size, device = input_ids.size(0), input_ids.device
        encoder_states = encode(model, input_ids, attention_mask)   # (B, S, d_model), once
        cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)   # (B, 1, 1, S), once
        # T5's bias of every distance a call can meet, made once: each call only gathers from it.
        # A query sits below position far = bound + k, where a padding slot is placed; a key in
        # the query's future (a negative distance, which indexes from the end) is hidden.
        far = bound + k
        past = past_distance_bias_table(model, far)                # (far + 1, heads): 0..far
        table = torch.cat([past, past.new_full((far, past.size(1)), torch.finfo(past.dtype).min)]).T
        # indexed by head and distance, so that the gathered bias is contiguous: T5's attention
        # would otherwise copy it in every layer
        head = torch.arange(table.size(0), device=device)[:, None, None]                # (heads, 1, 1)
        positions = torch.arange(max(far, batch_size), device=device)   # sliced below, never rebuilt
        cache = new_cache()
        rows = LiveRows(batch_size, device)
        # Per original example, read back once at the end. A live row has produced < bound tokens
        # and writes at most k more, so bound + k - 1 columns hold every write.
        produced = torch.full((batch_size, bound + k - 1), NOT_PRODUCED, dtype=torch.long, device=device)
        origin = rows.index[:, None]                     # (live, 1) each live row's example
        originals = list(range(batch_size))              # host: the same
        calls = [0] * batch_size                         # host: decoder calls per example
        # Per live row: tokens produced so far (= its own cache slots = position of fed[:, 0]), on
        # the device and, read back with each stop check, on the host (for the cache's shape).
        count = torch.zeros(batch_size, dtype=torch.long, device=device)                 # (live,)
        counts = [0] * batch_size
        cached = 0  # self-attention cache slots before the call = max(counts)
        # The first call feeds only the start token b at position 0 (no proposals yet); every later
        # call feeds a block of k: [last produced token, k-1 proposals].
        fed = torch.full((batch_size, 1), self.special.start, dtype=torch.long, device=device)  # (live, Q)
        batch_calls = 0
        while True:
            start = count[:, None]                                   # (live, 1): position of fed[:, 0]
            fed_pos = start + positions[: fed.size(1)]                                    # (live, Q)
            # Slot i < count holds position i; a padding slot is placed in the far future, so
            # that "visible iff not in the future" hides it as well.
            slot = positions[:cached]                                                     # (K,)
            key_pos = torch.cat([torch.where(slot < start, slot, far), fed_pos], dim=1)     # (live, K + Q)
            distance = fed_pos[:, :, None] - key_pos[:, None, :]                          # (live, Q, K + Q)
            bias = table[head, distance[:, None]]                                         # (live, heads, Q, K + Q)
            hidden = run_decoder(model, fed, bias, encoder_states, cross_mask, cache)  # (live, Q, d)
            batch_calls += 1

            base_logits = output_logits(model, hidden)               # (live, Q, V)
            base_pred = base_logits.argmax(-1)                       # (live, Q) greedy token after each
            if fed.size(1) > 1:
                # the base head at fed position j judges the proposal fed at j + 1
                if self.top_k == 1:
                    candidates = base_pred[:, :-1, None]             # (live, k-1, 1): exact
                else:
                    candidates = base_logits[:, :-1].topk(
                        min(self.top_k, base_logits.size(-1)), dim=-1).indices  # (live, k-1, top_k)
                accepted = accepted_length(fed[:, 1:], candidates)   # (live,)
            else:
                accepted = torch.zeros(fed.size(0), dtype=torch.long, device=device)
            # at each row's last accepted fed index: the base head's own token, and the state
            # the heads propose the next block from
            row = positions[: fed.size(0)]                           # (live,)
            base_next = base_pred[row, accepted]                     # (live,)
            proposals = self.proposal_logits(model, hidden[row, accepted]).argmax(-1)   # (live, k-1)

            tokens, ended = block_output(fed[:, 1:], accepted, base_next, end, bound - count)  # (live, Q), (live,)
            produced.index_put_((origin, fed_pos), tokens)
            new_count = count + (tokens != NOT_PRODUCED).sum(dim=1)  # (live,)
            if min(counts) + 1 >= bound:
                break  # every live row reaches max_new_tokens with this call: nothing to read back
            # The one sync of the call. A row that goes on took its block up to `accepted` whole
            # (no end token, no cut), so after compaction its own slots are exactly new_count.
            finished, new_counts = rows.read(torch.stack([ended, new_count]))
            done = [bool(end_token) or n >= bound for end_token, n in zip(finished, new_counts)]
            for b, example in enumerate(originals):
                if done[b]:
                    calls[example] = batch_calls   # rows are live from the first call until they leave
            kept = rows.drop(done, cache, encoder_states, cross_mask, base_next, proposals, count,
                             new_count, origin)
            if kept is None:
                break
            encoder_states, cross_mask, base_next, proposals, own, count, origin = kept
            originals = [originals[b] for b in rows.kept]
            counts = [new_counts[b] for b in rows.kept]
            # next block: the base head's token after the last accepted one, then the proposals
            fed = torch.cat([base_next[:, None], proposals], dim=1)  # (live, k)
            gather_self_attention_cache(cache, block_after_own_slots(
                own, cached, cache.get_seq_length(), max(counts)))
            cached = max(counts)
        for example in originals:   # the rows of the last call
            calls[example] = batch_calls

        read = produced.tolist()                                     # the one read-back of results
        outputs = [[t for t in row if t != NOT_PRODUCED] for row in read]
        split = [split_flat_output(tokens, self.special) for tokens in outputs]
        return DecodeOutput(
            subsequences=[subsequences for subsequences, _ in split],
            decoder_calls=calls,
            tokens=[len(tokens) for tokens in outputs],
            hit_max_steps=[not ended for _, ended in split],
            batch_decoder_calls=batch_calls,
            # mean accepted tokens per call = accepted_tokens / blockwise_iterations
            #                                 (= sum(tokens) / sum(decoder_calls))
            stats={"accepted_tokens": float(sum(len(tokens) for tokens in outputs)),
                   "blockwise_iterations": float(sum(calls))},
        )


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy ignoring -100; 0 (still connected to the graph) when nothing is
    scored, e.g. a head shifted past every target of a batch of short targets."""
    flat = labels.reshape(-1)
    summed = F.cross_entropy(at_least_float32(logits.reshape(flat.numel(), -1)), flat, ignore_index=-100,
                             reduction="sum")
    return summed / (flat != -100).sum().clamp(min=1)


def _detached_projection(model) -> SimpleNamespace:
    """A stand-in for `model` in `output_logits` whose `lm_head` uses detached weights, so gradients
    reach the heads but not the (frozen) shared output projection."""
    weights = {name: p.detach() for name, p in model.lm_head.named_parameters()}
    return SimpleNamespace(
        config=model.config,
        lm_head=lambda hidden: torch.func.functional_call(model.lm_head, weights, (hidden,)))
