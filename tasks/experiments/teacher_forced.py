"""Teacher-forced accuracy by place in the target: where a sequential-layout model's guesses fail.

    python -m tasks.experiments.teacher_forced --ckpt CKPT [--split validation] [--out FILE.json] \\
        [key=value ...]

Fed the reference's own prefix (teacher forcing, as in training), the model's argmax at each target
token is right or wrong. This counts both, with the mean loss, separately by the token's place in the
flat layout (s_1 <sep> s_2 ... s_m </s>): the first token of the 1st, 2nd, ... subsequence, a later
token of one, a separator, the end token. Where the first token of a subsequence is guessed wrong, it
also counts whether the guess is the first token of a later subsequence of the same target (the model
knows what comes but not in which order), of an earlier one (it would repeat one) or of none (it
would write something the target lacks). A set metric (em_f1 scores answers as a set) counts only
the last as wrong, while greedy decoding can turn an order guessed wrong into answers missed or
repeated.

For checkpoints of the sequential layout (trained with sequential or blockwise, the models lookup and
aggressive decode); any other is refused before data or model work. The split is read and cut to
the checkpoint's data limits, as its training targets were.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from datamodules.sources import SPLITS
from decoders.sequential import join_subsequences
from tasks.cli import base_parser, main_guard, show_report
from tasks.config import to_yaml
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import check_decoder, checkpoint_config, restore

# Subsequences from this one on share a row: few targets have more.
PLACES_NAMED = 5


def place_of(kind: str, k: int) -> str:
    """A place's row name: kind "start" with its subsequence's number k (1-based, the last named one
    standing for all later), or "inside", "separator", "end"."""
    if kind != "start":
        return kind
    return f"start of subsequence {k}" if k < PLACES_NAMED else f"start of subsequence {PLACES_NAMED}+"


def target_places(subsequences: list[list[int]]) -> list[tuple[str, int]]:
    """Each token of the flat target of `subsequences`, in order: ("start", k) for the first token of
    subsequence k (1-based), ("inside", k) for its later tokens, ("separator", k) after it, and
    ("end", m + 1) for the end token."""
    places = []
    for k, subsequence in enumerate(subsequences, start=1):
        if k > 1:
            places.append(("separator", k - 1))
        places += [("start", k)] + [("inside", k)] * (len(subsequence) - 1)
    return places + [("end", len(subsequences) + 1)]


@dataclass
class Tally:
    """One place's counts over a split."""

    tokens: int = 0
    right: int = 0
    loss: float = 0.0            # summed, in nats
    later_first: int = 0         # wrong starts guessing a later subsequence's first token
    earlier_first: int = 0       # wrong starts guessing an earlier one's (and no later one's)


def tally(tallies: dict[str, Tally], subsequences: list[list[int]], guesses: list[int],
          losses: list[float], sep: int, eos: int) -> None:
    """Add one example: its target `subsequences`, and at each token of its flat target (separator
    `sep`, end token `eos`) the model's argmax (`guesses`) and loss (`losses`)."""
    firsts = [subsequence[0] for subsequence in subsequences]
    flat = join_subsequences(subsequences, sep, eos)
    for (kind, k), token, guess, loss in zip(target_places(subsequences), flat, guesses, losses):
        counts = tallies.setdefault(place_of(kind, k), Tally())
        counts.tokens += 1
        counts.right += guess == token
        counts.loss += loss
        if kind == "start" and guess != token:
            if guess in firsts[k:]:
                counts.later_first += 1
            elif guess in firsts[: k - 1]:
                counts.earlier_first += 1


@torch.no_grad()
def teacher_forced_tallies(built, split: str) -> dict[str, Tally]:
    """Every place's tally over `split`, with the reference's prefix fed (the sequential layout)."""
    module = built.module.eval()
    special, tallies = module.decoder.special, {}
    loader = built.datamodule.ordered_loader(split)
    for batch in tqdm(loader, desc=f"teacher-forcing the {split} split", disable=len(loader) <= 1):
        labels = module.decoder.layout(batch["targets"])["labels"]                # (B, T); -100 past
        logits = module.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=labels).logits                           # (B, T, V)
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        for row, subsequences in enumerate(batch["targets"]):
            n = int((labels[row] != -100).sum())
            guesses = logits[row, :n].argmax(-1).tolist()
            tally(tallies, subsequences, guesses, losses[row, :n].tolist(), special.sep, special.eos)
    return tallies


def place_order(place: str) -> tuple:
    """Rows in target order: starts by subsequence, then inside, separator, end."""
    if place.startswith("start"):
        return (0, place)
    return (1, ("inside", "separator", "end").index(place))


def markdown(result: dict) -> str:
    lines = [f"{result['task']}, {result['split']} split of {result['data']}, checkpoint "
             f"{result['checkpoint']}: the model's argmax at each target token, the reference's "
             f"prefix fed", "",
             "| place in the target | tokens | right | mean loss (nats) | wrong: a later subsequence's "
             "first token | an earlier one's | no subsequence's first token |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        tokens = row["tokens"]
        wrong = (row["later_first"], row["earlier_first"],
                 tokens - row["right"] - row["later_first"] - row["earlier_first"])
        shares = [f"{n / tokens:.3f}" if row["place"].startswith("start") else "–" for n in wrong]
        lines.append(f"| {row['place']} | {tokens} | {row['right'] / tokens:.3f} | "
                     f"{row['loss'] / tokens:.3f} | {' | '.join(shares)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint of the sequential layout, written "
                                                      "by tasks.fit")
    parser.add_argument("--split", default="validation", choices=SPLITS)
    parser.add_argument("--out", help="also write the result as FILE.json and FILE.md")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    checkpoint = load_checkpoint(args.ckpt)
    check_decoder(checkpoint, args.ckpt, "sequential")
    cfg = checkpoint_config(checkpoint, args.ckpt, ["decoder=sequential", *args.overrides], args.config)
    if args.print_config:
        print(to_yaml(cfg))
        return {}

    built = restore(checkpoint, args.ckpt, cfg)
    tallies = teacher_forced_tallies(built, args.split)
    rows = [{"place": place, **asdict(tallies[place])} for place in sorted(tallies, key=place_order)]
    result = {"task": cfg.task.name, "data": cfg.data.get("path") or cfg.data.source,
              "split": args.split, "checkpoint": args.ckpt,
              "examples": len(built.datamodule.dataset(args.split)), "rows": rows}
    show_report(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main_guard(main)
