"""Would drafts from the source pay inside the pipelined layout? Decoder calls of an exact
pipelined + lookup decoder, counted on a pipelined checkpoint's own outputs.

    python -m tasks.bench.pipelined_lookup --ckpt P.ckpt [--draft-tokens 1,2,4] [--match 1] \\
        [--out results/pipelined_lookup_keyphrase.json]

The rule such a decoder would have to keep. In the pipelined layout token j of subsequence i sits at
time i*d + j, and its prediction sees what every earlier subsequence held by that time (docstring of
`decoders/pipelined.py`). A call may feed each running subsequence its newest token plus a lookup
draft (the source tokens after the latest occurrence of its last `match` tokens, as `decoders/lookup.py`
drafts), but a prediction at time T is the pipelined model's own only if every earlier running
subsequence holds real tokens up to time T, its accepted drafts of this call included. So a
subsequence keeps its agreeing draft prefix only as far as the earlier subsequences' frontiers
reach, and a subsequence starts once they reach its start time. Its output is then exactly
pipelined's, so its calls follow from pipelined's outputs and the sources alone (`replayed_calls`),
as lookup's follow from sequential's: no such decoder has to be built to count them. Without drafts
the rule is pipelined's own schedule, except that a subsequence whose earlier ones have all ended
may start before its slot (delay > 1 only; exact too); the table's first row is pipelined's calls as
decoded.

For each draft width it reports calls per example against pipelined's own, and the tokens each call
feeds (running subsequences x (1 + draft tokens)): the work per call that buys the saving. Examples
that hit a decoder bound are left out (their outputs were cut). One decode of the test split at
`eval.batch_size`; nothing is timed.
"""
from __future__ import annotations

import argparse
import math

import torch
from tqdm import tqdm

from tasks.cli import write_report
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore


def lookup_draft(source: list[int], produced: list[int], draft_tokens: int, match: int) -> list[int]:
    """The source tokens after the latest occurrence of the last `match` produced tokens that is
    followed by a source token (none while fewer than `match` are produced)."""
    if len(produced) < match or draft_tokens == 0:
        return []
    last = produced[-match:]
    for start in reversed(range(len(source) - match)):
        if source[start:start + match] == last:
            return source[start + match: start + match + draft_tokens]
    return []


def replayed_calls(subsequences: list[list[int]], source: list[int], delay: int,
                   draft_tokens: int, match: int) -> tuple[int, int]:
    """(decoder calls, tokens fed) of exact pipelined + lookup decoding of one example whose
    pipelined output is `subsequences` (each one's tokens up to and including its end token, the
    empty terminator [end] last, in start order). `draft_tokens` = 0 is plain pipelined decoding."""
    count = len(subsequences)
    produced = [0] * count     # tokens of subsequence i predicted so far
    started = 0                # subsequences 0..started-1 have started
    calls = fed = 0
    while started < count or any(produced[i] < len(subsequences[i]) for i in range(started)):
        calls += 1
        frontier = math.inf    # the earliest time up to which every earlier running subsequence is real
        for i in range(count):
            if i == started:   # starts once the earlier subsequences reach its start time
                if i * delay > frontier:
                    break
                started += 1
            tokens, n = subsequences[i], produced[i]
            if n == len(tokens):
                continue       # ended: all its tokens are real
            draft = lookup_draft(source, tokens[:n], draft_tokens, match)
            agree = 0
            while agree < len(draft) and n + agree < len(tokens) and draft[agree] == tokens[n + agree]:
                agree += 1
            # predictions at positions n .. n + accepted, times i*d + n ..: all within the frontier
            accepted = min(agree, frontier - (i * delay + n))
            fed += 1 + len(draft)
            produced[i] = n + accepted + 1   # agree stops before the last token: within its tokens
            frontier = min(frontier, i * delay + n + accepted)
    return calls, fed


def outputs(built, batch_size: int, end: int) -> list[tuple[list[list[int]], list[int], int]]:
    """Each test example's pipelined subsequences (end tokens restored, the empty terminator last),
    its source and its decoder calls, for the examples that ended by themselves."""
    module, dataset = built.module.eval(), built.datamodule.dataset("test")
    decoder, size = module.decoder, batch_size
    examples, kept = dataset.examples, []
    for first in tqdm(range(0, len(examples), size), desc="pipelined decode", unit="batch"):
        batch_examples = examples[first:first + size]
        batch = built.datamodule.collate(batch_examples)
        with torch.no_grad():
            out = decoder.generate(module.backbone, batch["input_ids"], batch["attention_mask"])
        for example, subsequences, hit, calls in zip(batch_examples, out.subsequences,
                                                     out.bound_hit, out.decoder_calls):
            if hit:
                continue
            with_ends = [s + [end] for s in subsequences]
            if len(subsequences) < decoder.max_subsequences:
                with_ends.append([end])   # the empty subsequence that stopped it
            kept.append((with_ends, example.source_ids, calls))
    return kept


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a pipelined checkpoint written by tasks.fit")
    parser.add_argument("--draft-tokens", default="1,2,4", help="comma-separated draft widths")
    parser.add_argument("--match", type=int, default=1)
    parser.add_argument("--out", default="pipelined_lookup.json")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.draft_tokens.split(",")]
    if min(widths) < 1 or args.match < 1:
        parser.error(f"--draft-tokens {args.draft_tokens!r} and --match {args.match} must be >= 1")
    checkpoint = load_checkpoint(args.ckpt)
    cfg = checkpoint_config(checkpoint, args.ckpt, [])
    if cfg.decoder.name != "pipelined" or cfg.decoder.stop_rule != "first_empty":
        parser.error(f"--ckpt {args.ckpt}: decoder {cfg.decoder.name!r}; a pipelined checkpoint "
                     f"with stop_rule first_empty is needed")
    built = restore(checkpoint, args.ckpt, cfg)
    delay = built.module.decoder.delay
    kept = outputs(built, cfg.eval.batch_size, built.module.decoder.special.eos)
    tokens = sum(len(s) for subs, _, _ in kept for s in subs)
    decoded_calls = sum(calls for _, _, calls in kept)
    rows = [{"draft_tokens": "pipelined, decoded", "calls_per_example": decoded_calls / len(kept),
             "tokens_per_call": tokens / decoded_calls, "fed_per_call": None}]
    for width in [0, *widths]:
        replays = [replayed_calls(subs, source, delay, width, args.match) for subs, source, _ in kept]
        calls, fed = sum(c for c, _ in replays), sum(f for _, f in replays)
        rows.append({"draft_tokens": width, "calls_per_example": calls / len(kept),
                     "tokens_per_call": tokens / calls, "fed_per_call": fed / calls})
    for row in rows:
        row["call_ratio"] = rows[0]["calls_per_example"] / row["calls_per_example"]
    result = {"checkpoint": args.ckpt, "task": cfg.task.name, "delay": delay,
              "match": args.match, "examples": len(kept), "rows": rows}
    lines = [f"exact pipelined + lookup, replayed on pipelined's own outputs ({cfg.task.name}, "
             f"delay {delay}, match {args.match}, {len(kept)} test examples that ended by themselves)",
             "", "| draft tokens | calls/ex | fewer calls than pipelined | tokens/call | tokens fed/call |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['draft_tokens']} | {r['calls_per_example']:.2f} | {r['call_ratio']:.3f}x | "
              f"{r['tokens_per_call']:.2f} | "
              f"{'–' if r['fed_per_call'] is None else format(r['fed_per_call'], '.2f')} |" for r in rows]
    table = "\n".join(lines) + "\n"
    path = write_report(args.out, result, table)
    print(table)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
