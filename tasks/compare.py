"""Compare decoders side by side: same data, model size, seed and training budget; one table.

    python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar \\
        [--out FILE.json] [--ckpt NAME=PATH ...] [--sweep decoder.delay=1,2,3] [key=value ...]

Each decoder is trained (or loaded with --ckpt) and its test split decoded and scored as its own
MLflow run. A --ckpt checkpoint must have been trained for its row of the plan (the same task, data,
model and, for the same decoder, trained options; checked before any work); its row is scored under
the comparison's settings like every other row. Then speed is measured for all of them in this one
process, with the same thread count, after a warm-up, interleaving the decoders and taking the
median of `--repeats` passes: examples per second at batch size 1 and at `eval.batch_size`, timing
only `generate` (encoder + decoder calls) on batches prepared beforehand. Timing runs on the device
the trainer settings give (`trainer.accelerator`, `trainer.devices`), with denormal floats flushed
to zero on a CPU. Peak memory is taken in a separate pass at the eval batch size (CUDA: max
allocated; CPU: the C heap in use, sampled every millisecond), over its level before the decode. The
device and the flushing are recorded with the results. Writes FILE.json, FILE.md and two plots next
to them, and a summary run to MLflow, all tagged with one comparison id.
"""
from __future__ import annotations

import ctypes
import json
import statistics
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities import move_data_to_device
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from decoders import build_decoder, decoder_class
from datamodules.tokenizer import special_tokens
from tasks.config import ConfigError, compose
from tasks.module import TASK_MODULES, GenerationTask, timed_generate
from tasks.test import check_decoder, restore
from tasks.run import (write_report, Built, base_parser, check_tracking, config_differences, decode_device,
                       decoder_options, is_model_key, load_checkpoint, log, main_guard, open_tracking,
                       score_into_run, train_and_test)


@dataclass
class Row:
    cfg: DictConfig
    module: GenerationTask
    datamodule: object
    logger: object
    quality: dict = field(default_factory=dict)     # the task's metrics on the test split
    telemetry: dict = field(default_factory=dict)   # decoder calls, tokens per call, ...
    speed: dict = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)   # per test example, batch size 1
    swept: list[str] = field(default_factory=list)         # options this row's sweep set

    @property
    def options(self) -> dict:
        return decoder_options(self.cfg)

    @property
    def label(self) -> str:
        return row_label(self.cfg, self.swept)


# -- planning -----------------------------------------------------------------------------------

def row_label(cfg: DictConfig, swept: list[str]) -> str:
    """The decoder's name, with the values of the options its sweep set: `nar(iterations=2)`."""
    settings = ",".join(f"{k}={cfg.decoder[k]}" for k in swept)
    return f"{cfg.decoder.name}({settings})" if settings else cfg.decoder.name


def parse_decoders(text: str) -> list[str]:
    """`--decoders a,b,c` -> names; an unknown name fails here, listing the registered ones."""
    decoders = [d.strip() for d in text.split(",") if d.strip()]
    if not decoders:
        raise ConfigError(f"--decoders {text!r} names no decoder")
    for name in decoders:
        try:
            decoder_class(name)
        except ValueError as err:
            raise ConfigError(f"--decoders: {err}") from err
    return decoders


def parse_sweeps(items: list[str]) -> dict[str, list[str]]:
    sweeps = {}
    for item in items:
        key, _, values = item.partition("=")
        if not key.startswith("decoder.") or not values:
            raise ConfigError(f"--sweep {item!r}: expected decoder.OPTION=v1,v2,... "
                              f"(e.g. decoder.delay=1,2,3)")
        sweeps[key] = values.split(",")
    return sweeps


def parse_checkpoints(items: list[str], names: list[str] | None = None) -> dict[str, str]:
    """`--ckpt NAME=PATH` items -> {NAME: PATH}, each NAME once (and one of `names`, if given)."""
    checkpoints: dict[str, str] = {}
    for item in items:
        name, equals, path = item.partition("=")
        if not equals or not name or not path or (names is not None and name not in names):
            among = f" with NAME one of --decoders ({', '.join(names)})" if names else ""
            example = names[0] if names else "pipelined"
            raise ConfigError(f"--ckpt {item!r}: expected NAME=PATH{among}, e.g. --ckpt "
                              f"{example}=last.ckpt")
        if name in checkpoints:
            raise ConfigError(f"--ckpt {name}=...: given twice ({checkpoints[name]} and {path})")
        checkpoints[name] = path
    return checkpoints


def plan(task: str, decoders: list[str], config_file: str | None, overrides: list[str],
         sweeps: dict[str, list[str]]) -> list[tuple[DictConfig, list[str]]]:
    """One resolved config (and the options its sweep set) per row. `decoder.X=v` overrides and sweeps apply to the decoders that
    have option X; naming an option no listed decoder has is an error."""
    general = [o for o in overrides if not o.startswith("decoder.")]
    specific = [o for o in overrides if o.startswith("decoder.")]
    options = {name: set(compose(task, name, config_file, general).decoder) for name in decoders}
    for item in specific + [f"{k}=" for k in sweeps]:
        key = item.split("=", 1)[0].split(".", 1)[1]
        if not any(key in opts for opts in options.values()):
            raise ConfigError(f"{item.split('=')[0]}: no decoder among {', '.join(decoders)} has "
                              f"option {key!r}; their options: "
                              + "; ".join(f"{n}: {', '.join(sorted(o - {'name'}))}"
                                          for n, o in options.items()))
    rows = []
    for name in decoders:
        own = [o for o in specific if o.split("=", 1)[0].split(".", 1)[1] in options[name]]
        grid = [[]]
        for key, values in sweeps.items():
            if key.split(".", 1)[1] in options[name]:
                grid = [g + [f"{key}={v}"] for g in grid for v in values]
        for settings in grid:
            rows.append((compose(task, name, config_file, general + own + settings),
                         [s.split("=")[0].split(".", 1)[1] for s in settings]))
    return rows


def training_key(cfg: DictConfig) -> str:
    """Rows that differ only in decode-time options share one trained model."""
    decode_only = decoder_class(cfg.decoder.name).decode_options
    trained = {k: v for k, v in cfg.decoder.items() if k not in decode_only}
    rest = {k: v for k, v in cfg.items() if k != "decoder"}
    return json.dumps([trained, OmegaConf.to_container(OmegaConf.create(rest), resolve=True)],
                      sort_keys=True, default=str)


# -- training / loading and scoring ---------------------------------------------------------------

# Data settings that say where files are kept or how they are read, not which data: the only ones in
# which a --ckpt checkpoint may differ from the plan.
DATA_STORAGE_KEYS = ("data.tokenizer_cache", "data.num_workers", "data.cache_dir")


def check_checkpoint(checkpoint: dict, path: str, cfg: DictConfig) -> None:
    """Refuse a --ckpt checkpoint that was not trained for its planned row `cfg`: another task,
    other data, another model, a decoder layout `cfg`'s decoder cannot decode or, for the same
    decoder, other values of options that shape training. The ConfigError names the checkpoint and
    each key with its value in the checkpoint and in the plan."""
    check_decoder(checkpoint, f"--ckpt {cfg.decoder.name}={path}", cfg.decoder.name)
    stored_decoder = checkpoint["hyper_parameters"]["cfg"]["decoder"]["name"]
    decode_only = decoder_class(cfg.decoder.name).decode_options

    def compared(key: str) -> bool:
        group, _, option = key.partition(".")
        if group == "decoder":  # another decoder's options have other names: its layout was checked
            return stored_decoder == cfg.decoder.name and option not in decode_only + ("name",)
        return group == "task" or (group == "data" and key not in DATA_STORAGE_KEYS) or is_model_key(key)

    differences = config_differences(checkpoint, cfg, "in the checkpoint", compared, "in the plan")
    if differences:
        raise ConfigError(f"--ckpt {cfg.decoder.name}={path} was not trained for this comparison "
                          f"({'; '.join(differences)}); set the plan's keys to the checkpoint's "
                          f"values, or train it again")


def score_row(cfg: DictConfig, built, tags: dict) -> Row:
    """Decode and score the test split with an already-trained module, as a new MLflow run."""
    logger = open_tracking(cfg, f"{cfg.decoder.name} {cfg.model.name} {cfg.data.source}", tags=tags)
    score_into_run(logger, cfg, built)
    return Row(cfg, built.module, built.datamodule, logger)


def with_decoder(cfg: DictConfig, trained) -> object:
    """The trained backbone and decoder modules under a decoder built with `cfg`'s options."""
    module = trained.module
    decoder = build_decoder(cfg.decoder.name, module.backbone.config, special_tokens(module.tokenizer),
                            **decoder_options(cfg))
    decoder.load_state_dict(module.decoder.state_dict())
    new = TASK_MODULES[cfg.task.name](cfg, module.backbone, decoder, module.tokenizer)
    return Built(trained.datamodule, new)


# -- timing ---------------------------------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _heap_in_use() -> int | None:
    """Bytes of C heap in use (glibc mallinfo2: small blocks + mmapped blocks), None off glibc.

    Torch's CPU tensors live on this heap, and unlike the resident set it falls when they are
    freed, so its peak during a decode is the decode's own working memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMemory:
    """Peak memory of a block over its level before: CUDA max allocated, or on CPU the C heap in
    use (sampled every millisecond in a thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _heap_in_use() or 0
            self._peak = self._base
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, _heap_in_use() or 0)
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._running = False
            self._thread.join()
            peak = self._peak
        self.peak_mb = (peak - self._base) / 2 ** 20


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats to zero (torch sets the mode but cannot report
    it): a denormal float32 times one stays denormal unless flushed."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


@contextmanager
def flushed_denormals(device: torch.device):
    """On a CPU, denormal floats flushed to zero for the block, then the previous mode restored;
    yields whether they are flushed. A random model with a large init scale spends most of a CPU
    decode in denormal arithmetic, which GPUs do at full speed: unflushed, CPU timings would
    measure how many denormals a decoder meets rather than its work. (torch sets the mode of the
    calling thread only: work it splits over its other intra-op threads is not flushed.)"""
    if device.type != "cpu":
        yield False
        return
    before = flushing_denormals()
    flushed = torch.set_flush_denormal(True)  # False where the CPU cannot
    try:
        yield flushed
    finally:
        torch.set_flush_denormal(before)


def time_row(row: Row, batch: dict) -> float:
    module = row.module
    return timed_generate(module.decoder, module.backbone, batch["input_ids"], batch["attention_mask"])[1]


def measure_speed(rows: list[Row], device: torch.device, batch_size: int, repeats: int,
                  limit: int | None) -> dict:
    """Interleaved, warmed-up timing of every row on `device`, on the same prepared batches.

    Returns the conditions of the timing: the device the modules' parameters were on while timed
    and whether denormals were flushed."""
    datamodule = rows[0].datamodule
    examples = datamodule.dataset("test").examples[:limit]
    # moved to the device beforehand, so that the copies are not timed
    singles = [move_data_to_device(datamodule.collate([e]), device) for e in examples]
    batches = [move_data_to_device(datamodule.collate(examples[i:i + batch_size]), device)
               for i in range(0, len(examples), batch_size)]
    for row in rows:
        # Lightning's test teardown left the module on the CPU, whatever the trainer ran on
        row.module.to(device)
        row.module.eval()
    single_runs = {id(r): [] for r in rows}
    batch_runs = {id(r): [] for r in rows}
    with flushed_denormals(device) as flushed, torch.inference_mode():
        for row in rows:
            for batch in singles[:3] + batches[:1]:
                time_row(row, batch)
        timed_on = str(next(rows[0].module.parameters()).device)
        with tqdm(total=repeats * len(rows), desc="timing decoders") as bar:
            for _ in range(repeats):
                for row in rows:
                    single_runs[id(row)].append([time_row(row, b) for b in singles])
                    batch_runs[id(row)].append(sum(time_row(row, b) for b in batches))
                    bar.update()
        for row in rows:
            runs = single_runs[id(row)]
            row.latencies = [statistics.median(times) for times in zip(*runs)]
            row.speed["examples_per_second_bs1"] = len(examples) / statistics.median(sum(r) for r in runs)
            row.speed["examples_per_second_batch"] = len(examples) / statistics.median(batch_runs[id(row)])
            with PeakMemory(device) as memory:
                for batch in batches:
                    time_row(row, batch)
            row.speed["peak_memory_mb"] = memory.peak_mb
    return {"device": timed_on, "flush_denormal": flushed}


# -- reporting ------------------------------------------------------------------------------------

def reference_calls(decoder, datamodule, split: str = "test") -> list[int] | None:
    """Per example of `split`, the decoder calls that producing its references would take with
    `decoder` (`Decoder.calls_for_output`); None where that depends on the model."""
    calls = [decoder.calls_for_output(example.target_ids) for example in datamodule.dataset(split)]
    return None if None in calls or not calls else calls


def reference_calls_per_example(row: Row) -> float | None:
    """Mean calls the test references need with this row's decoder: next to the calls the trained
    model took, it tells a cheaper decoder from a model that writes less."""
    calls = reference_calls(row.module.decoder, row.datamodule)
    return None if calls is None else statistics.mean(calls)


def report(rows: list[Row], cfg: DictConfig, threads: int, timing: dict) -> dict:
    """The comparison's JSON: one entry per row, with the conditions of the timing (`timing`, from
    `measure_speed`)."""
    reference = next((r for r in rows if r.cfg.decoder.name == "sequential"), None)
    out_rows = []
    for row in rows:
        calls = row.telemetry.get("decoder_calls_per_example")
        # test outputs stopped by a decoder bound (every decoder's: data.max_target_length output
        # tokens, plus pipelined's slot limits) rather than by their own end token
        hits, examples = int(row.telemetry["max_steps_hit"]), len(row.module.telemetry.rows)
        entry = {
            "decoder": row.cfg.decoder.name, "label": row.label, "options": row.options,
            "quality": row.quality,
            "examples_per_second_bs1": row.speed["examples_per_second_bs1"],
            "examples_per_second_batch": row.speed["examples_per_second_batch"],
            "speedup_bs1": None, "speedup_batch": None,
            "decoder_calls_per_example": calls,
            "reference_calls_per_example": reference_calls_per_example(row),
            "tokens_per_call": row.telemetry.get("tokens_per_call"),
            "bound_hits": hits, "bound_hit_fraction": hits / examples if examples else None,
            "peak_memory_mb": row.speed["peak_memory_mb"],
            "mlflow_run_id": row.logger.run_id,
        }
        if reference is not None:
            for key in ("bs1", "batch"):
                entry[f"speedup_{key}"] = (row.speed[f"examples_per_second_{key}"]
                                           / reference.speed[f"examples_per_second_{key}"])
        out_rows.append(entry)
    data = cfg.data.path if cfg.data.source == "jsonl" else cfg.data.source
    device = timing["device"]
    return {"task": cfg.task.name, "data": data, "model": cfg.model.name, "device": device,
            "threads": threads, "flush_denormal": timing["flush_denormal"],
            "eval_batch_size": cfg.eval.batch_size,
            "memory": "CUDA max allocated" if device.startswith("cuda")
            else "CPU heap-in-use growth during decoding (glibc mallinfo2, sampled)", "rows": out_rows}


def markdown(result: dict) -> str:
    """The table: F-measures and ROUGE shown, precision/recall left to the JSON."""
    shown = [k for k in result["rows"][0]["quality"]
             if not any(part in k for part in ("_p_", "_r_", "precision", "recall"))]

    def fmt(value, digits=3):
        return "–" if value is None else f"{value:.{digits}f}"

    head = ["decoder", *shown, "ex/s bs1", "ex/s batch", "speedup bs1", "speedup batch",
            "calls/ex", "reference calls/ex", "tokens/call", "bound hits", "peak MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["label"], *(fmt(r["quality"][k]) for k in shown),
                 fmt(r["examples_per_second_bs1"], 1), fmt(r["examples_per_second_batch"], 1),
                 fmt(r["speedup_bs1"], 2), fmt(r["speedup_batch"], 2),
                 fmt(r["decoder_calls_per_example"], 1), fmt(r["reference_calls_per_example"], 1),
                 fmt(r["tokens_per_call"], 2),
                 f"{r['bound_hits']} ({fmt(r['bound_hit_fraction'], 3)})",
                 fmt(r["peak_memory_mb"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    flushed = ", denormals flushed to zero" if result["flush_denormal"] else ""
    caption = (f"{result['task']} on {result['data']}, model {result['model']}, {result['device']}, "
               f"{result['threads']} threads{flushed}, eval batch {result['eval_batch_size']}; "
               f"memory = {result['memory']}")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def plots(rows: list[Row], result: dict, stem: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    reference = next((r for r in rows if r.cfg.decoder.name == "sequential"), None)
    if reference is not None:
        counts = [len(e.target_ids) for e in reference.datamodule.dataset("test").examples]
        fig, ax = plt.subplots(figsize=(6, 4))
        for row in rows:
            if row is reference:
                continue
            by_count: dict[int, list[float]] = {}
            for n, ref_t, t in zip(counts, reference.latencies, row.latencies):
                by_count.setdefault(n, []).append(ref_t / t)
            xs = sorted(by_count)
            ax.plot(xs, [statistics.mean(by_count[x]) for x in xs], marker="o", label=row.label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("target subsequences per example")
        ax.set_ylabel("speedup over sequential (batch size 1)")
        ax.legend()
        fig.tight_layout()
        paths.append(stem.with_name(stem.name + "_speedup_vs_subsequences.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    primary = rows[0].module.primary_metric.split("/", 1)[1]
    for r in result["rows"]:
        ax.scatter(r["examples_per_second_bs1"], r["quality"].get(primary, 0.0))
        ax.annotate(r["label"], (r["examples_per_second_bs1"], r["quality"].get(primary, 0.0)))
    ax.set_xlabel("examples per second (batch size 1)")
    ax.set_ylabel(primary)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "_quality_vs_speed.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


# -- entry point ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--task", default="keyphrase")
    parser.add_argument("--decoders", default="sequential,pipelined",
                        help="comma-separated registered decoder names")
    parser.add_argument("--out", default="comparison.json", help="where to write the JSON result")
    parser.add_argument("--ckpt", action="append", default=[], metavar="NAME=PATH",
                        help="reuse a checkpoint for decoder NAME instead of training")
    parser.add_argument("--sweep", action="append", default=[], metavar="decoder.OPTION=v1,v2",
                        help="one row per value, for the decoders that have OPTION")
    parser.add_argument("--repeats", type=int, default=3, help="timing passes (median is reported)")
    parser.add_argument("--speed-examples", type=int, default=None,
                        help="time on the first N test examples (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come anywhere

    started = time.perf_counter()
    decoders = parse_decoders(args.decoders)
    checkpoints = parse_checkpoints(args.ckpt, decoders)
    for flag, value in (("--repeats", args.repeats), ("--speed-examples", args.speed_examples),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    planned = plan(args.task, decoders, args.config, args.overrides, parse_sweeps(args.sweep))
    cfgs = [cfg for cfg, _ in planned]
    if args.print_config:
        for cfg in cfgs:
            print(OmegaConf.to_yaml(cfg))
        return {}
    loaded = {name: load_checkpoint(path) for name, path in checkpoints.items()}
    for cfg, _ in planned:
        if cfg.decoder.name in loaded:
            check_checkpoint(loaded[cfg.decoder.name], checkpoints[cfg.decoder.name], cfg)
    # the rows differ in decoder options only: one check of the other settings holds for all
    device = decode_device(cfgs[0])
    check_tracking(cfgs[0])
    if args.threads:
        torch.set_num_threads(args.threads)

    comparison_id = uuid.uuid4().hex[:12]
    tags = {"comparison_id": comparison_id, "role": "row"}
    trained: dict[str, object] = {}
    rows: list[Row] = []
    for cfg, swept in planned:
        key = training_key(cfg)
        name = cfg.decoder.name
        if key in trained:
            row = score_row(cfg, with_decoder(cfg, trained[key]), tags)
        elif name in checkpoints:
            built = restore(loaded[name], checkpoints[name], cfg)
            trained[key] = built
            row = score_row(cfg, built, {**tags, "checkpoint": checkpoints[name]})
        else:
            log.info("training %s", name)
            result = train_and_test(cfg, tags=tags)
            trained[key] = result.built
            row = Row(cfg, result.built.module, result.built.datamodule, result.logger)
        row.swept = swept
        row.quality = dict(row.module.quality_scores)
        row.telemetry = dict(row.module.test_scores)
        rows.append(row)

    timing = measure_speed(rows, device, cfgs[0].eval.batch_size, args.repeats, args.speed_examples)
    result = report(rows, cfgs[0], torch.get_num_threads(), timing)
    conditions = {key: result[key] for key in ("device", "threads", "flush_denormal")}
    for row, entry in zip(rows, result["rows"]):
        metrics = {f"test/{k}": entry[k] for k in ("examples_per_second_bs1", "examples_per_second_batch",
                                                   "speedup_bs1", "speedup_batch", "peak_memory_mb")
                   if entry[k] is not None}
        row.logger.log_metrics(metrics)
        row.logger.log_hyperparams({f"speed.{key}": value for key, value in conditions.items()})

    table = markdown(result)
    out = write_report(args.out, result, table)
    images = plots(rows, result, out.with_suffix(""))
    summary = open_tracking(cfgs[0], f"comparison {comparison_id}",
                            tags={"comparison_id": comparison_id, "role": "summary"})
    summary.log_hyperparams(conditions)
    for path in [out, out.with_suffix(".md"), *images]:
        summary.experiment.log_artifact(summary.run_id, str(path))
    summary.finalize("success")
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}, {', '.join(map(str, images))}; comparison id "
          f"{comparison_id}; total wall time {time.perf_counter() - started:.1f}s")
    return result


if __name__ == "__main__":
    main_guard(main)
