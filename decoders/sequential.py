"""Sequential decoder: the standard T5 layout and greedy decoding, one token per decoder call.

Reference: Raffel et al. 2020 (T5); this is the baseline every other decoder is compared with.

Layout: the target subsequences s_1..s_m are joined by a separator token and closed by the end token,
    labels = s_1 <sep> s_2 <sep> ... s_m </s>, decoder input = labels shifted right after `b`.
Loss:   token cross-entropy of T5's own forward.
Decode: greedy, cached: feed `b`, then each argmax token, one decoder call per token, until `</s>` or
        `max_new_tokens`. It yields exactly the tokens of transformers' `generate(do_sample=False,
        num_beams=1)` on the same model; finished rows are dropped from the batch (and the cache) so
        they cost nothing more. The decoder blocks run through `run_decoder` with T5's causal bias
        gathered from a table made once, not through `T5Stack.forward`, whose mask building reads a
        device value back every call: one host sync per call is left, the stop check.
        Compiled (`decoder.compile`), its calls take a few fixed shapes: a cache of the bound's
        slots, made whole before the first call, written at slot = step and attended in widths of
        ATTENDED_SLOTS_STEP slots (those past the step hidden by the bias), the source padded to a
        few widths, and the finished rows kept in the batch (their tokens discarded) until the
        unfinished ones fit half of it, when it shrinks in place to the power of two that holds
        them; so a few graphs per batch size and source width serve every step of every decode.
        Its compiled step is the whole call: the decoder layers, the output head, the argmax and
        the loop's bookkeeping of the step (which rows finished, the token each row keeps),
        `next_tokens` through `backbone.fixed_shape_compiled`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from decoders import register
from datamodules.vocabulary import pad_batch
from decoders.backbone import (cross_attention_mask, decoder_inputs, fixed_shape_compiled,
                               fixed_shape_start, greedy_step_as_compiled, made_from_bias_weight,
                               output_logits, past_distance_bias_table, sizes)
from decoders.base import OUTPUT_BOUND, Decoder
from decoders.cache import DecoderCache, Slots, attended_width, power_of_two_holding
from decoders.loop import CallTokens, LiveRows, NOT_PRODUCED, ShrunkRows, flat_decode_output


def join_subsequences(subsequences: list[list[int]], sep: int, eos: int) -> list[int]:
    """s_1 <sep> s_2 ... s_m </s>: the flat target of the sequential and non-autoregressive layouts."""
    flat: list[int] = []
    for i, sub in enumerate(subsequences):
        if i:
            flat.append(sep)
        flat.extend(sub)
    return flat + [eos]


@register("sequential")
class SequentialDecoder(Decoder):
    layout_family = "flat-causal"  # blockwise trains its base head on this same layout
    options = {"max_new_tokens": OUTPUT_BOUND}

    def layout(self, targets):
        flat = [join_subsequences(subs, self.special.sep, self.special.eos) for subs in targets]
        return {"labels": pad_batch(flat, -100)}  # (B, target_len); -100 = ignored by the loss

    def calls_for_output(self, subsequences):
        return len(join_subsequences(subsequences, self.special.sep, self.special.eos))  # one per token

    def loss(self, model, input_ids, attention_mask, layout):
        # use_cache=False: teacher forcing computes every position's keys and values at once, so a
        # cache would only copy them; the decoder inputs given, as every family shifts alike
        labels = layout["labels"]
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                     decoder_input_ids=decoder_inputs(model, labels), use_cache=False).loss

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        encoder_states = self.encoder_pass()(model, input_ids, attention_mask)
        outputs, calls = greedy_outputs(self, model, encoder_states, attention_mask)
        return flat_decode_output(outputs, self.special, [len(tokens) for tokens in outputs], calls)


def greedy_outputs(decoder: Decoder, model: PreTrainedModel, encoder_states: torch.Tensor,
                   attention_mask: torch.Tensor) -> tuple[list[list[int]], int]:
    """Sequential decoding from the encoder output (B, S, d_model) under `decoder`'s bound, special
    tokens, model step and compile option: each row's tokens, its end token included where it has
    one, read back once, and the calls the batch took. The sequential decoder's generation, and
    that of a lookup decode that feeds no draft."""
    loop = fixed_shape_loop if decoder.compiles() else eager_loop
    tokens, calls = loop(decoder, model, encoder_states, attention_mask)
    return tokens.rows(encoder_states.size(0)), calls


def eager_loop(decoder: Decoder, model: PreTrainedModel, encoder_states: torch.Tensor,
               attention_mask: torch.Tensor) -> tuple[CallTokens, int]:
    """Every call's tokens and the calls taken; finished rows leave the batch and the cache."""
    batch_size, device, bound = encoder_states.size(0), encoder_states.device, decoder.max_new_tokens
    cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)   # (B, 1, 1, S), once
    steps = growing_steps(model, bound)
    cache = DecoderCache(sizes(model.config).layers)
    rows = LiveRows(batch_size, device)
    produced = CallTokens()
    step_input = torch.full((batch_size, 1), decoder.special.start, dtype=torch.long, device=device)
    run = decoder.model_step()
    for step in range(bound):
        # the token at position `step` writes its keys and values at slot `step`
        bias, slots, positions = steps[step]
        hidden = run(model, step_input, bias, encoder_states, cross_mask, cache, slots,
                     positions)                                        # (live, 1, d_model)
        next_tokens = output_logits(model, hidden[:, -1]).argmax(-1)   # (live,)
        produced.add(rows.index, next_tokens)
        if step + 1 == bound:
            break
        kept = rows.drop_finished(next_tokens == decoder.special.eos, cache, encoder_states,
                                  cross_mask, next_tokens)
        if kept is None:
            break
        encoder_states, cross_mask, next_tokens = kept
        step_input = next_tokens[:, None]
    return produced, step + 1


def fixed_shape_loop(decoder: Decoder, model: PreTrainedModel, encoder_states: torch.Tensor,
                     attention_mask: torch.Tensor) -> tuple[CallTokens, int]:
    """The eager loop's tokens and calls, every call in one of a few shapes, compiled once per
    shape (`next_tokens` through `fixed_shape_compiled`): the source padded to a few widths
    (`backbone.fixed_source_width`), finished rows kept (their later tokens not produced) until
    the unfinished ones fit a batch of half the rows or fewer, which then holds them, topped up
    with finished rows to a power of two (`shrunk_rows`)."""
    batch_size, device, bound = encoder_states.size(0), encoder_states.device, decoder.max_new_tokens
    cache, encoder_states, cross_mask = fixed_shape_start(model, encoder_states, attention_mask, bound)
    steps = fixed_shape_steps(model, bound, batch_size)
    rows = LiveRows(batch_size, device)
    end = torch.tensor(decoder.special.eos, device=device)   # a tensor: no graph per end token
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    produced = CallTokens()
    step_input = torch.full((batch_size, 1), decoder.special.start, dtype=torch.long, device=device)
    compiled = {}   # attended slots' width -> the batch's compiled step
    for step in range(bound):
        bias, slots, positions = steps[step]
        call = compiled.get(slots.width)
        if call is None:   # looked up once per decode and rows: the lookup costs a share of a call
            # one compiled function per shape: the rows, the source's and the attended slots'
            # widths, the cache's slots
            call = compiled[slots.width] = fixed_shape_compiled(
                model, next_tokens, (step_input.size(0), encoder_states.size(1), slots.width, bound))
        step_input, kept, finished = call(model, step_input, finished, end, bias, encoder_states,
                                          cross_mask, cache, slots, positions)
        produced.add(rows.index, kept)
        if step + 1 == bound:
            break
        done = rows.read(finished)
        if all(done):
            break
        # no row leaves before one has ended
        if any(done) and (shrunk := shrunk_rows(done)).rows < len(done):
            encoder_states, cross_mask, step_input, finished = rows.shrink(
                shrunk, cache, step + 1, encoder_states, cross_mask, step_input, finished)
            steps, compiled = fixed_shape_steps(model, bound, shrunk.rows), {}
    return produced, step + 1


def next_tokens(model: PreTrainedModel, step_input: torch.Tensor, finished: torch.Tensor,
                end: torch.Tensor, *step: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of a fixed-shape sequential decode (`greedy_step_as_compiled` of `step_input`
    (B, 1) and the rest of the call `step`), with its bookkeeping: the next call's input (B, 1),
    the token each row keeps (B,) (NOT_PRODUCED where the row had `finished` before), and which
    rows have finished after it (B,): those that had, and those whose token is `end`."""
    _, tokens = greedy_step_as_compiled(model, step_input, *step)      # (B, 1)
    token = tokens[:, -1]
    return tokens, token.masked_fill(finished, NOT_PRODUCED), finished | (token == end)


def shrunk_rows(done: list[bool]) -> ShrunkRows:
    """How a fixed-shape batch shrinks, given which rows are `done`: to the power of two that holds
    its unfinished rows, once that is fewer rows than it has (else it keeps them all), each
    unfinished row past those moved into the place of a finished one before it; the other
    finished rows before it stay, to fill it. So the batch takes few sizes, and the rows that stay
    in place are not copied."""
    size = power_of_two_holding(done.count(False))
    if size >= len(done):
        return ShrunkRows(len(done), [], [])
    moved = [row for row in range(size, len(done)) if not done[row]]
    places = [row for row in range(size) if done[row]][:len(moved)]
    return ShrunkRows(size, moved, places)


class Step(NamedTuple):
    """What the call of one step of sequential decoding is given besides its tokens."""

    bias: torch.Tensor        # (1, heads, 1, keys) the causal bias of its query over the cache's keys
    slots: Slots              # where it writes its keys and values
    positions: torch.Tensor   # (1, 1) its token's position, the step


def growing_steps(model: PreTrainedModel, bound: int) -> list[Step]:
    """The steps of an eager decode: step t appends at slot t and attends slots 0..t. T5's causal
    bias, made once per model weights and bound: the query of step t sees keys 0..t, which lie
    t..0 steps in its past, i.e. the last t + 1 columns of the flipped table of distances
    bound - 1 .. 0."""
    def make() -> list[Step]:
        past = past_distance_bias_table(model, bound - 1).flip(0).T[None, :, None]  # (1, heads, 1, bound)
        positions = torch.arange(bound, device=past.device)[None]                  # (1, bound)
        return [Step(past[..., bound - 1 - t:], Slots(start=t), positions[:, t: t + 1])
                for t in range(bound)]
    return made_from_bias_weight(model, ("growing steps", bound), make)


def fixed_shape_steps(model: PreTrainedModel, bound: int, batch_size: int) -> list[Step]:
    """The steps of a compiled decode, in a few shapes: step t writes every row at slot t of a
    cache of up to `bound` slots and attends its first slots, t + 1 rounded up to a multiple of
    ATTENDED_SLOTS_STEP (at most `bound`), those past t hidden by its bias. Each step's tensors are
    tensors of their own (a view's offset would differ from step to step), made once per model
    weights, bound and batch size, so that later decodes reuse them."""
    def make() -> list[Step]:
        table = past_distance_bias_table(model, bound - 1)                     # (bound, heads)
        t = torch.arange(bound, device=table.device)
        distance = t[:, None] - t[None, :]                                     # (step, slot)
        bias = table[distance.clamp(min=0)].permute(0, 2, 1)                   # (step, heads, slot)
        bias = bias.masked_fill((distance < 0)[:, None], torch.finfo(bias.dtype).min)
        every_row = torch.arange(batch_size, device=table.device)[:, None]     # (B, 1)
        steps = []
        for step in range(bound):
            width = attended_width(step + 1, bound)
            steps.append(Step(bias[step, None, :, None, :width].clone(),
                              Slots(each=t[step].expand(batch_size, 1).clone(), rows=every_row,
                                    width=width),
                              t[step].view(1, 1).clone()))
        return steps
    return made_from_bias_weight(model, ("fixed-width steps", bound, batch_size), make)
