"""Plain pipelined decoding: Algorithm 1 of Huang et al. with no cache, no batching and no packed
state, the reference the fast decoder (`decoders/pipelined.py`) is checked against, as transformers
checks cached generation against uncached.

Each example is decoded alone. At time step t its subsequence t/d starts with b (every d steps,
while new starts are allowed and a slot is left); then the logits of every running subsequence's
newest token are recomputed from ALL the tokens the example has fed so far, in one pass of the
training forward (`teacher_forced_logits` on a layout of those tokens at their grid positions),
and each running subsequence gets its argmax. The stop rules and bounds, as the decoder's module
docstring states them:
- a subsequence ends at e or after `max_subsequence_length` tokens;
- the output, counted as the flat layout counts it (every token of a subsequence, its e too, but
  not the empty terminator's e), holds at most `max_new_tokens` tokens: a step's tokens are kept in
  subsequence order up to the bound, and a token past it ends the example;
- first_empty: a subsequence whose first token is e stops new starts; the example is done when
  nothing runs and nothing can start. all_end: it is done after the first step at which nothing
  runs;
- at most `max_steps` steps.
An example was cut by a bound (`bound_hit`) if it was still decoding after `max_steps`, if a
token did not fit `max_new_tokens`, if a subsequence reached `max_subsequence_length` without e, if
under first_empty it never wrote its empty terminator, or if a subsequence was due to start while
it was decoding and no slot was left.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoders.base import DecodeOutput


@dataclass
class Subsequence:
    """One started subsequence (a failed exploration or the empty terminator too)."""

    fed: list[int]                                      # b, then each token it went on after
    emitted: list[int] = field(default_factory=list)    # its tokens that fit the output bound
    running: bool = True
    cut: bool = False                                   # it emitted a token past the output bound


@dataclass
class Example:
    """One example's decoding."""

    subsequences: list[Subsequence] = field(default_factory=list)   # subsequence i = slot i
    call_steps: list[int] = field(default_factory=list)             # the steps with a decoder call
    logits: dict = field(default_factory=dict)    # (subsequence, offset) -> (vocab,) logits
    may_start: bool = True
    done: bool = False
    denied_start: bool = False    # a subsequence was due to start and no slot was left


def reference_decode(decoder, model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Decode every example alone with `decoder`'s options. Returns (DecodeOutput, logits) where
    logits maps (example, subsequence, offset) -> the (vocab,) logits computed at that position."""
    examples = [decode_example(decoder, model, input_ids[b:b + 1], attention_mask[b:b + 1])
                for b in range(input_ids.size(0))]
    output = DecodeOutput(
        subsequences=[output_subsequences(example, decoder.special.eos) for example in examples],
        decoder_calls=[len(example.call_steps) for example in examples],
        tokens=[sum(len(s.emitted) for s in example.subsequences) for example in examples],
        bound_hit=[cut_by_a_bound(decoder, example) for example in examples],
        # the batch makes a call at every step at which some example does
        batch_decoder_calls=len({step for example in examples for step in example.call_steps}))
    logits = {(b, i, j): value for b, example in enumerate(examples)
              for (i, j), value in example.logits.items()}
    return output, logits


def decode_example(decoder, model, input_ids, attention_mask) -> Example:
    """Algorithm 1 for one example, (1, source_len) inputs."""
    example = Example()
    for step in range(decoder.step_bound):
        if step % decoder.delay == 0 and example.may_start:    # lines 5-7: every d steps
            if step // decoder.delay < decoder.max_subsequences:
                example.subsequences.append(Subsequence(fed=[decoder.special.start]))
            else:
                example.denied_start = True
        if any(s.running for s in example.subsequences):
            example.call_steps.append(step)
            append_next_tokens(decoder, model, input_ids, attention_mask, example)
        # lines 12-13
        can_start = example.may_start and len(example.subsequences) < decoder.max_subsequences
        if not any(s.running for s in example.subsequences) and (
                decoder.stop_rule == "all_end" or not can_start):
            example.done = True
            return example
    return example


def append_next_tokens(decoder, model, input_ids, attention_mask, example: Example) -> None:
    """Lines 8-11: one uncached pass over every token fed so far gives each running subsequence its
    next token (the argmax at its newest token), kept in subsequence order while the output bound
    allows."""
    cells = [(i, j) for i, s in enumerate(example.subsequences) for j in range(len(s.fed))]
    layout = {"tokens": [token for s in example.subsequences for token in s.fed],
              "subsequence": [i for i, _ in cells], "offset": [j for _, j in cells]}
    layout = {name: torch.tensor([values], device=input_ids.device) for name, values in layout.items()}
    layout["valid"] = torch.ones_like(layout["tokens"], dtype=torch.bool)
    logits = decoder.teacher_forced_logits(model, input_ids, attention_mask, layout)[0]  # (N, vocab)

    eos = decoder.special.eos
    output_length = sum(len(s.emitted) for s in example.subsequences if s.emitted != [eos])
    running = [(i, s) for i, s in enumerate(example.subsequences) if s.running]
    tokens = []
    for i, s in running:
        j = len(s.fed) - 1
        example.logits[(i, j)] = logits[cells.index((i, j))]
        token = int(example.logits[(i, j)].argmax())
        tokens.append(token)
        empty = token == eos and j == 0
        output_length += not empty    # the empty terminator's e is no output
        if output_length > decoder.max_new_tokens:
            s.cut = True
        else:
            s.emitted.append(token)
        if empty and decoder.stop_rule == "first_empty":
            example.may_start = False
    over = any(s.cut for _, s in running)
    for (_, s), token in zip(running, tokens):
        if over or token == eos or len(s.fed) == decoder.max_subsequence_length:
            s.running = False
        else:
            s.fed.append(token)
    if over:   # a cut output starts nothing more
        example.may_start = False


def output_subsequences(example: Example, eos: int) -> list[list[int]]:
    """The non-empty subsequences, in order, without their end tokens."""
    out = [s.emitted[:-1] if s.emitted[-1:] == [eos] else s.emitted for s in example.subsequences]
    return [tokens for tokens in out if tokens]


def cut_by_a_bound(decoder, example: Example) -> bool:
    """Whether the example's output was cut by a bound (module docstring)."""
    eos, length = decoder.special.eos, decoder.max_subsequence_length
    never_ended = any(len(s.emitted) == length and s.emitted[-1] != eos for s in example.subsequences)
    no_terminator = decoder.stop_rule == "first_empty" and not any(
        s.emitted[:1] == [eos] for s in example.subsequences)
    return (not example.done or any(s.cut for s in example.subsequences) or never_ended
            or no_terminator or example.denied_start)
