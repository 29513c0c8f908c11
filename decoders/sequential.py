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
        Compiled (`decoder.compile`), its calls take a few fixed shapes: a cache of up to the
        bound's slots written at slot = step and attended in widths of ATTENDED_SLOTS_STEP slots
        (those past the step hidden by the bias), the source padded to a power of two, and the
        finished rows kept in the batch, their tokens discarded; so a few graphs per batch size and
        source width serve every step of every decode.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from decoders import register
from datamodules.vocabulary import pad_batch
from decoders.backbone import (cross_attention_mask, decoder_inputs, encode, made_from_bias_weight,
                               output_logits, past_distance_bias_table, sizes, source_at_fixed_width)
from decoders.base import OUTPUT_BOUND, Decoder
from decoders.cache import DecoderCache, Slots
from decoders.loop import LiveRows, NOT_PRODUCED, flat_decode_output


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
    fixed_shape_calls = True

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
        batch_size, device, bound = input_ids.size(0), input_ids.device, self.max_new_tokens
        encoder_states = encode(model, input_ids, attention_mask)
        fixed_shapes = self.compiles()
        if fixed_shapes:
            encoder_states, attention_mask = source_at_fixed_width(encoder_states, attention_mask)
        cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)   # (B, 1, 1, S), once
        steps = (fixed_shape_steps(model, bound, batch_size) if fixed_shapes
                 else growing_steps(model, bound))
        cache = DecoderCache(sizes(model.config).layers, most_slots=bound)
        rows = LiveRows(batch_size, device)
        finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        produced = torch.full((batch_size, bound), NOT_PRODUCED, dtype=torch.long, device=device)
        step_input = torch.full((batch_size, 1), self.special.start, dtype=torch.long, device=device)
        run = self.model_step()
        for step in range(bound):
            # the token at position `step` writes its keys and values at slot `step`
            bias, slots, positions = steps[step]
            hidden = run(model, step_input, bias, encoder_states, cross_mask, cache, slots,
                         positions)                                        # (live, 1, d_model)
            next_tokens = output_logits(model, hidden[:, -1]).argmax(-1)   # (live,)
            ends = next_tokens == self.special.eos
            if fixed_shapes:   # every row stays: a finished row's later tokens are not produced
                produced[:, step] = next_tokens.masked_fill(finished, NOT_PRODUCED)
                finished = finished | ends
                if step + 1 == bound or rows.read(finished.all()):
                    break
            else:              # finished rows leave the batch and the cache
                produced[rows.index, step] = next_tokens
                if step + 1 == bound:
                    break
                kept = rows.drop_finished(ends, cache, encoder_states, cross_mask, next_tokens)
                if kept is None:
                    break
                encoder_states, cross_mask, next_tokens = kept
            step_input = next_tokens[:, None]

        outputs = [[t for t in row if t != NOT_PRODUCED] for row in produced.tolist()]  # read once
        return flat_decode_output(outputs, self.special, [len(tokens) for tokens in outputs], step + 1)


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


# Slots a compiled step attends grow in steps of this many: a few widths, each one shape.
ATTENDED_SLOTS_STEP = 32


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
            width = min(bound, -(-(step + 1) // ATTENDED_SLOTS_STEP) * ATTENDED_SLOTS_STEP)
            steps.append(Step(bias[step, None, :, None, :width].clone(),
                              Slots(each=t[step].expand(batch_size, 1).clone(), rows=every_row,
                                    width=width),
                              t[step].view(1, 1).clone()))
        return steps
    return made_from_bias_weight(model, ("fixed-width steps", bound, batch_size), make)
