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
"""
from __future__ import annotations

import torch

from decoders import register
from datamodules.vocabulary import pad_batch
from decoders.backbone import (cross_attention_mask, decoder_inputs, encode, output_logits,
                               past_distance_bias_table, sizes)
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
        cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)   # (B, 1, 1, S), once
        # T5's causal bias, computed once: the query of step t sees keys 0..t, which lie t..0 steps
        # in its past, i.e. the last t + 1 columns of `past` (distances bound-1 .. 0).
        past = past_distance_bias_table(model, bound - 1).flip(0).T[None, :, None]  # (1, heads, 1, bound)
        cache = DecoderCache(sizes(model.config).layers)
        positions = torch.arange(bound, device=device)[None]                      # (1, bound)
        rows = LiveRows(batch_size, device)
        produced = torch.full((batch_size, bound), NOT_PRODUCED, dtype=torch.long, device=device)
        step_input = torch.full((batch_size, 1), self.special.start, dtype=torch.long, device=device)
        run = self.model_step()
        for step in range(bound):
            # the token at position `step` writes its keys and values at slot `step`
            hidden = run(model, step_input, past[..., bound - 1 - step:], encoder_states, cross_mask,
                         cache, Slots(start=step), positions[:, step: step + 1])   # (live, 1, d_model)
            next_tokens = output_logits(model, hidden[:, -1]).argmax(-1)   # (live,)
            produced[rows.index, step] = next_tokens
            if step + 1 == bound:
                break
            kept = rows.drop_finished(next_tokens == self.special.eos, cache, encoder_states,
                                      cross_mask, next_tokens)
            if kept is None:
                break
            encoder_states, cross_mask, next_tokens = kept
            step_input = next_tokens[:, None]

        outputs = [[t for t in row if t != NOT_PRODUCED] for row in produced.tolist()]  # read once
        return flat_decode_output(outputs, self.special, [len(tokens) for tokens in outputs], step + 1)
