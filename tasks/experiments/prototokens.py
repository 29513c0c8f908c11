"""How much can a frozen decoder write in ONE pass? Proto-token reconstruction on a trained checkpoint.

    python -m tasks.experiments.prototokens --ckpt CKPT [--texts 16] [--lengths 1,2,4,8,16,32,64]
        [--arrangement e-m,e-e,e-m-alternating] [--share none|m|e] [--context with,without]
        [--restarts 3] [--iterations 5000] [--lr 0.1] [--weight-decay 0.01] [--split test]
        [--seed 0] [--out prototokens.json] [key=value ...]

Mezentsev & Oseledets, "Exploring the Hidden Capacity of LLMs for One-Step Text Generation"
(2025), Sections 3-4, on an encoder-decoder: the checkpoint's
backbone (sequential layout) is frozen; for each of the first N examples of the split, its flat
target (s_1 <sep> ... </s>, what the sequential decoder is trained on) is cut to each length L
(an example shorter than L is left out of that length). The decoder's input embeddings are replaced
by an arrangement of two proto-tokens e and m, drawn from a standard normal; only they are optimised
(AdamW, cross-entropy of output position i against token i, early stop at perfect reconstruction),
in one decoder call under T5's causal mask (`decoders.prototoken.one_pass_logits`, the machinery of
the `onestep` decoder). The decoder cross-attends to the example's encoded source (`--context with`)
or to the encoding of an empty source, the end token alone (`without`).

Arrangements: e-m = [e, m, ..., m] (the paper's), e-e = [e, ..., e] (one proto-token),
e-m-alternating = [e, m, e, m, ...], m-e = [m, e, ..., e] (the roles swapped).
Sharing: none (e and m per text), m (one m per length and restart, shared by the texts; e per
text), e (one e per length and restart shared, m per text).
Accuracy (the paper's): the positions whose argmax is the target token, counted and as a fraction
of L. Per text the best of `--restarts` random initialisations, each at its best iteration;
`iterations` = the iteration at which it was perfect (with sharing: all texts sharing its
proto-token), or the whole budget.
Defaults: AdamW, lr 0.1, weight decay 0.01, betas (0.9, 0.999), 5000 iterations. The budget is the
paper's (5k steps); its learning-rate and weight-decay figures are lost from the text we have. The
learning rate was chosen on a t5-tiny of the tests' size (d_model 32, one epoch on 32 built-in
keyphrase examples; 4 targets, e-m, best of 2 restarts, 5000 iterations): lr 0.1 reconstructed
0.94 of 4-token and 0.50 of 8-token prefixes, lr 0.01 0.81 and 0.44. Measure again on a real model.

Each (arrangement, context, length) is one batched optimisation of its texts and restarts: AdamW
is elementwise and the loss is a sum of per-problem losses, so each problem (a text, or the texts
that share a proto-token) is optimised as it would be alone; solved problems leave the batch.

Writes FILE.json and FILE.png (mean accuracy vs length, one line per arrangement and context), and
an MLflow run in the task's experiment with the settings, accuracies (step = length) and both files.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from datamodules.tokenizer import special_tokens
from decoders import decoder_class
from datamodules.vocabulary import pad_batch
from decoders.backbone import at_least_float32, encode
from decoders.backbone import with_frozen_weights
from decoders.onestep import one_pass_logits
from decoders.sequential import join_subsequences
from tasks.config import ConfigError, to_yaml
from tasks.cli import base_parser, log, main_guard
from tasks.runs.checkpoints import load_checkpoint, trained_decoder
from tasks.runs.tracking import ExceptionWatcher, log_params, open_tracking, run_link, run_status
from tasks.runs.trainer import decode_target
from tasks.runs.restore import checkpoint_config, restore

# position (W,) -> (W,) True where the input is e, False where it is m
ARRANGEMENTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "e-m": lambda position: position == 0,
    "e-e": lambda position: position >= 0,
    "e-m-alternating": lambda position: position % 2 == 0,
    "m-e": lambda position: position > 0,
}
SHARES = ("none", "m", "e")
CONTEXTS = ("with", "without")


@dataclass
class Reconstruction:
    """Per restart r and target t, the best the optimisation reached."""
    correct: torch.Tensor     # (R, T) positions whose argmax was the target token, at the best iteration
    perfect: torch.Tensor     # (R, T) bool: its problem (all texts sharing with it) was reconstructed exactly
    iterations: torch.Tensor  # (R, T) the iteration its problem became perfect, else the budget
    e: torch.Tensor           # (R, T, d_model) the proto-tokens at the best iteration
    m: torch.Tensor           # (R, T, d_model)


def reconstruct(model, start: int, targets: list[list[int]], encoder_states: torch.Tensor,
                encoder_mask: torch.Tensor, arrangement: str, share: str, restarts: int,
                iterations: int, lr: float, weight_decay: float,
                generator: torch.Generator) -> Reconstruction:
    """Optimise proto-tokens so that the frozen `model`'s decoder writes each target in one call.

    targets: T token lists (of one length, so that no position is padding, though any lengths
    work); encoder_states: (T, S, d_model) what target t's decoder cross-attends to, encoder_mask:
    (T, S). Rows of the batch are (restart, target), restart-major. A problem (what is optimised
    and early-stopped together) is a row, or with sharing all rows of one restart. The model must
    be in eval mode (dropout would make the reconstruction random); its weights are used detached
    and stay untouched.
    """
    if model.training:
        raise ValueError("reconstruct needs the model in eval mode (dropout would randomise it)")
    if share not in SHARES:
        raise ValueError(f"share must be one of {SHARES}, got {share!r}")
    device, dtype, d_model = encoder_states.device, encoder_states.dtype, model.config.d_model
    count = len(targets)
    rows = restarts * count
    row = torch.arange(rows, device=device)
    target_of_row, restart_of_row = row % count, row // count                           # (rows,)
    problem = row if share == "none" else restart_of_row
    problems = rows if share == "none" else restarts
    e_index = restart_of_row if share == "e" else row                                   # (rows,)
    m_index = restart_of_row if share == "m" else row

    # the paper's initialisation: standard normal, drawn on the CPU (reproducible everywhere)
    e_table = torch.randn(int(e_index.max()) + 1, d_model, generator=generator, dtype=dtype)
    m_table = torch.randn(int(m_index.max()) + 1, d_model, generator=generator, dtype=dtype)
    e_table, m_table = (t.to(device).requires_grad_() for t in (e_table, m_table))
    optimizer = torch.optim.AdamW([e_table, m_table], lr=lr, weight_decay=weight_decay)

    labels = pad_batch(targets, -100).to(device)[target_of_row]                         # (rows, W)
    lengths = torch.tensor([len(t) for t in targets], device=device)[target_of_row]     # (rows,)
    problem_tokens = torch.zeros(problems, dtype=torch.long, device=device).index_add_(0, problem, lengths)
    uses_e = ARRANGEMENTS[arrangement](torch.arange(labels.size(1), device=device))     # (W,)
    start_embedding = model.get_input_embeddings().weight[start].detach()               # (d_model,)

    best = torch.full((problems,), -1, dtype=torch.long, device=device)   # correct positions
    best_iteration = torch.zeros(problems, dtype=torch.long, device=device)  # when `best` was first reached
    row_correct = torch.zeros(rows, dtype=torch.long, device=device)
    best_e = torch.zeros(rows, d_model, dtype=dtype, device=device)
    best_m = torch.zeros(rows, d_model, dtype=dtype, device=device)
    live = row                                                               # rows of unsolved problems
    for step in range(iterations + 1):
        width = int(lengths[live].max())
        e, m = e_table[e_index[live]], m_table[m_index[live]]                # (live, d_model)
        inputs = torch.where(uses_e[:width, None], e[:, None], m[:, None])  # (live, W, d_model)
        source = target_of_row[live]
        logits = with_frozen_weights(model, one_pass_logits, start, inputs - start_embedding,
                                     encoder_states[source], encoder_mask[source])  # (live, W, V)
        row_labels = labels[live, :width]
        hits = (logits.argmax(-1) == row_labels).sum(1)                      # (live,); -100 never hits
        live_problem = problem[live]
        correct = torch.zeros(problems, dtype=torch.long, device=device).index_add_(0, live_problem, hits)
        improved = torch.zeros(problems, dtype=torch.bool, device=device)
        improved[live_problem] = correct[live_problem] > best[live_problem]
        rows_improved = improved[live_problem]                               # (live,)
        best = torch.where(improved, correct, best)
        best_iteration = torch.where(improved, step, best_iteration)
        row_correct[live[rows_improved]] = hits[rows_improved]
        best_e[live[rows_improved]] = e.detach()[rows_improved]
        best_m[live[rows_improved]] = m.detach()[rows_improved]
        solved = best == problem_tokens                                      # (problems,)
        if step == iterations or bool(solved.all()):
            break
        # one loss per problem (mean over its positions), summed: problems do not interact
        token_loss = F.cross_entropy(at_least_float32(logits).transpose(1, 2), row_labels,
                                     ignore_index=-100, reduction="none")    # (live, W)
        per_problem = torch.zeros(problems, dtype=token_loss.dtype, device=device).index_add_(
            0, live_problem, token_loss.sum(1))
        optimizer.zero_grad()
        (per_problem / problem_tokens).sum().backward()
        optimizer.step()
        live = live[~solved[live_problem]]
    used = torch.where(solved, best_iteration, iterations)
    return Reconstruction(correct=row_correct.view(restarts, count),
                          perfect=solved[problem].view(restarts, count),
                          iterations=used[problem].view(restarts, count),
                          e=best_e.view(restarts, count, d_model),
                          m=best_m.view(restarts, count, d_model))


# -- the command ----------------------------------------------------------------------------------

def parse_list(flag: str, text: str, allowed=None, convert=str) -> list:
    """`a,b,c` -> items; an empty list, an item that does not convert or is not allowed fails
    naming the flag, the item and what is allowed."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{flag} {text!r} names nothing")
    out = []
    for item in items:
        try:
            value = convert(item)
        except ValueError as err:
            raise ConfigError(f"{flag}: {item!r} is not a valid value ({err})") from err
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{flag}: {item!r} is not one of {', '.join(allowed)}")
        out.append(value)
    return list(dict.fromkeys(out))  # repeated items once, in order


def check_settings(args) -> None:
    for flag, value, low in (("--texts", args.texts, 1), ("--restarts", args.restarts, 1),
                             ("--iterations", args.iterations, 0)):
        if value < low:
            raise ConfigError(f"{flag}={value} must be >= {low}")
    if not args.lr > 0:
        raise ConfigError(f"--lr={args.lr} must be > 0")
    if not args.weight_decay >= 0:
        raise ConfigError(f"--weight-decay={args.weight_decay} must be >= 0")


def run_case(model, start: int, flats: list[list[int]], ids: list[str], sources: dict,
             length: int, arrangement: str, context: str, args,
             generator: torch.Generator) -> dict:
    """One (arrangement, context, length): the texts whose flat target `flats` reaches `length`,
    their prefixes optimised together; the summary, with each text's best restart."""
    texts = [ti for ti, flat in enumerate(flats) if len(flat) >= length]
    summary = {"arrangement": arrangement, "context": context, "length": length, "texts": len(texts)}
    if not texts:
        return summary
    states, mask = sources[context]                                  # (N or 1, S, d_model), (N or 1, S)
    source = texts if context == "with" else [0] * len(texts)
    result = reconstruct(model, start, [flats[ti][:length] for ti in texts], states[source],
                         mask[source], arrangement, args.share, args.restarts, args.iterations,
                         args.lr, args.weight_decay, generator)
    correct, used = result.correct.tolist(), result.iterations.tolist()
    per_text = []
    for column, ti in enumerate(texts):
        # the best restart: most correct positions, then fewest iterations
        r = max(range(args.restarts), key=lambda r: (correct[r][column], -used[r][column]))
        per_text.append({"id": ids[ti], "correct": correct[r][column],
                         "accuracy": correct[r][column] / length,
                         "perfect": correct[r][column] == length,  # this text (its group may not be)
                         "iterations": used[r][column], "restart": r})
    summary.update({
        "correct_mean": statistics.mean(t["correct"] for t in per_text),
        "accuracy_mean": statistics.mean(t["accuracy"] for t in per_text),
        "perfect": sum(t["perfect"] for t in per_text),
        "iterations_mean": statistics.mean(t["iterations"] for t in per_text),
        "per_text": per_text})
    return summary


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    cases = dict.fromkeys((r["arrangement"], r["context"]) for r in results)
    for arrangement, context in cases:
        points = [(r["length"], r["accuracy_mean"]) for r in results
                  if (r["arrangement"], r["context"]) == (arrangement, context) and r["texts"]]
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="-" if context == "with" else "--",
                    label=f"{arrangement}, {context} context")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["length"] for r in results}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("target length L (tokens)")
    ax.set_ylabel("reconstruction accuracy (mean over texts)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a tasks.fit checkpoint of the sequential layout")
    parser.add_argument("--texts", type=int, default=16, help="the first N examples of the split")
    parser.add_argument("--lengths", default="1,2,4,8,16,32,64", help="target prefix lengths L")
    parser.add_argument("--arrangement", default="e-m,e-e,e-m-alternating",
                        help=f"comma-separated, of: {', '.join(ARRANGEMENTS)}")
    parser.add_argument("--share", default="none", choices=SHARES,
                        help="a proto-token shared by the texts of a length (none: neither)")
    parser.add_argument("--context", default="with,without",
                        help="cross-attend to the encoded source (with) or to an empty one (without)")
    parser.add_argument("--restarts", type=int, default=3, help="random initialisations per text")
    parser.add_argument("--iterations", type=int, default=5000, help="AdamW steps at most")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
    parser.add_argument("--seed", type=int, default=0, help="seeds the proto-tokens' initialisation")
    parser.add_argument("--out", default="prototokens.json", help="the JSON (and .png beside it)")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere
    lengths = sorted(parse_list("--lengths", args.lengths, convert=_positive_int))
    arrangements = parse_list("--arrangement", args.arrangement, allowed=list(ARRANGEMENTS))
    contexts = parse_list("--context", args.context, allowed=list(CONTEXTS))
    check_settings(args)

    checkpoint = load_checkpoint(args.ckpt)
    trained = trained_decoder(checkpoint)
    if not decoder_class("sequential").can_decode_checkpoint_of(decoder_class(trained)):
        raise ConfigError(f"checkpoint {args.ckpt} was trained with decoder {trained!r}, whose "
                          f"backbone is not of the sequential layout that tasks.experiments.prototokens "
                          f"reconstructs with")
    # the backbone as the sequential decoder has it (other decoders' modules are not needed)
    cfg = checkpoint_config(checkpoint, args.ckpt, [*args.overrides, "decoder=sequential"], args.config)
    if args.print_config:
        print(to_yaml(cfg))
        return {}
    started = time.perf_counter()
    device = decode_target(cfg).device
    logger = open_tracking(cfg, f"prototokens {cfg.model.name} {cfg.data.source}",
                           tags={"role": "prototokens", "checkpoint": args.ckpt})  # fails here if unusable
    built = restore(checkpoint, args.ckpt, cfg)
    model = built.module.backbone.to(device).eval()
    special = special_tokens(built.datamodule.tokenizer, model.config.decoder_start_token_id)
    records = built.datamodule.records(args.split)
    examples = built.datamodule.dataset(args.split).examples[:args.texts]
    ids = [str(records[example.index]["id"]) for example in examples]
    # what the sequential decoder is trained to write: s_1 <sep> ... </s>
    flats = [join_subsequences(example.target_ids, special.sep, special.eos) for example in examples]
    with torch.no_grad():
        input_ids = pad_batch([e.source_ids for e in examples], special.pad).to(device)
        mask = (input_ids != special.pad).long()
        empty = torch.tensor([[special.eos]], device=device)
        sources = {"with": (encode(model, input_ids, mask), mask),
                   "without": (encode(model, empty, torch.ones_like(empty)), torch.ones_like(empty))}

    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for arrangement in arrangements:
        for context in contexts:
            for length in lengths:
                case_started = time.perf_counter()
                results.append(run_case(model, special.start, flats, ids, sources, length,
                                        arrangement, context, args, generator))
                if results[-1]["texts"]:
                    log.info("%s, %s context, L=%d: accuracy %.3f, %d of %d perfect (%.1fs)",
                             arrangement, context, length, results[-1]["accuracy_mean"],
                             results[-1]["perfect"], results[-1]["texts"],
                             time.perf_counter() - case_started)

    settings = {"checkpoint": args.ckpt, "split": args.split, "texts": len(examples),
                "lengths": lengths, "arrangements": arrangements, "share": args.share,
                "contexts": contexts, "restarts": args.restarts, "seed": args.seed,
                "optimizer": {"name": "AdamW", "lr": args.lr, "weight_decay": args.weight_decay,
                              "betas": [0.9, 0.999], "iterations": args.iterations,
                              "init": "standard normal",
                              "early_stop": "perfect reconstruction"}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image = out.with_suffix(".png")
    plot(results, image, f"{cfg.task.name}, {cfg.model.name}, {args.split} split, share {args.share}, "
                         f"best of {args.restarts}, {args.iterations} iterations")
    with run_status(logger, ExceptionWatcher()):  # the MLflow run exists from the first log on
        log_params(logger, cfg, built.datamodule, (args.split,))
        logger.log_hyperparams({f"prototokens.{k}": v for k, v in settings.items()})
        for r in results:
            if r["texts"]:
                logger.log_metrics({f"accuracy/{r['arrangement']}/{r['context']}": r["accuracy_mean"],
                                    f"perfect/{r['arrangement']}/{r['context']}": r["perfect"] / r["texts"]},
                                   step=r["length"])
        result = {**settings, "device": str(device), "mlflow_run_id": logger.run_id,
                  "results": results}
        out.write_text(json.dumps(result, indent=2))
        for path in (out, image):
            logger.experiment.log_artifact(logger.run_id, str(path))
    logger.finalize("success")
    log.info("wrote %s and %s; MLflow run %s; wall time %.1fs", out, image, logger.run_id,
             time.perf_counter() - started)
    log.info("in the MLflow UI: %s", run_link(cfg, logger))
    return result


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("a length must be >= 1")
    return value


if __name__ == "__main__":
    main_guard(main)
