"""Sequential decoder: the standard T5 layout and greedy decoding, one token per decoder call.

Reference: Raffel et al. 2020 (T5); this is the baseline every other decoder is compared with.

Layout: the target subsequences s_1..s_m are joined by a separator token and closed by the end token,
    labels = s_1 <sep> s_2 <sep> ... s_m </s>, decoder input = labels shifted right after `b`.
Loss:   token cross-entropy of T5's own forward.
Decode: greedy, cached: feed `b`, then each argmax token, one decoder call per token, until `</s>` or
        `max_new_tokens`. It yields exactly the tokens of transformers' `generate(do_sample=False,
        num_beams=1)` on the same model; finished rows are dropped from the batch (and the cache) so
        they cost nothing more.
"""
from __future__ import annotations

import torch

from decoders import register
from decoders.base import (DecodeOutput, Decoder, SpecialTokens, drop_finished_rows, encode,
                           new_cache, output_logits, pad_batch, split_on)


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
    decode_options = ("max_new_tokens",)
    def __init__(self, backbone_config, special: SpecialTokens, max_new_tokens: int = 128):
        super().__init__(backbone_config, special)
        if max_new_tokens < 1:
            raise ValueError(f"decoder.max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens

    def layout(self, targets):
        flat = [join_subsequences(subs, self.special.sep, self.special.eos) for subs in targets]
        return {"labels": pad_batch(flat, -100)}  # (B, target_len); -100 = ignored by the loss

    def calls_for_output(self, subsequences):
        return len(join_subsequences(subsequences, self.special.sep, self.special.eos))  # one per token

    def loss(self, model, input_ids, attention_mask, layout):
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=layout["labels"]).loss

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        batch_size = input_ids.size(0)
        encoder_states = encode(model, input_ids, attention_mask)
        cache = new_cache()
        rows = torch.arange(batch_size, device=input_ids.device)  # original index of each live row
        step_input = torch.full((batch_size, 1), self.special.start, dtype=torch.long,
                                device=input_ids.device)
        produced: list[list[int]] = [[] for _ in range(batch_size)]
        batch_calls = 0
        for _ in range(self.max_new_tokens):
            hidden = model.decoder(input_ids=step_input, encoder_hidden_states=encoder_states,
                                   encoder_attention_mask=attention_mask, past_key_values=cache,
                                   use_cache=True).last_hidden_state
            batch_calls += 1
            next_tokens = output_logits(model, hidden[:, -1]).argmax(-1)  # (live rows,)
            for row, token in zip(rows.tolist(), next_tokens.tolist()):
                produced[row].append(token)
            finished = next_tokens == self.special.eos
            if finished.all():
                break
            if finished.any():
                keep = (~finished).nonzero().squeeze(1)
                encoder_states, attention_mask, rows, next_tokens = drop_finished_rows(
                    cache, keep, encoder_states, attention_mask, rows, next_tokens)
            step_input = next_tokens[:, None]

        ended = [bool(p) and p[-1] == self.special.eos for p in produced]
        return DecodeOutput(
            subsequences=[split_on(p[:-1] if end else p, self.special.sep)
                          for p, end in zip(produced, ended)],
            decoder_calls=[len(p) for p in produced],
            tokens=[len(p) for p in produced],
            hit_max_steps=[not end for end in ended],
            batch_decoder_calls=batch_calls,
        )
