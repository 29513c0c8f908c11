"""Compare decoders side by side: same data, model size, seed and training budget; one table.

    python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar \\
        [--out FILE.json] [--ckpt NAME=PATH ...] [--sweep decoder.delay=1,2,3] \\
        [--backbone from-sequential|own] [key=value ...]

Each decoder is trained (or loaded with --ckpt) and its test split decoded and scored as its own
MLflow run. With sequential among the decoders, a decoder that can build on a trained sequential
model (blockwise, onestep: `Decoder.builds_on_sequential`) trains on the sequential row's tested
checkpoint (`train.init_from`), its backbone frozen, as Stern et al. add heads to a trained model:
its quality is the sequential row's by construction. `--backbone own` trains blockwise's base head
jointly with its heads instead; the user's own `train.init_from` or `decoder.freeze_backbone` wins;
the table's `training` column says which was used. A --ckpt checkpoint must have been trained for
its row of the plan (the same task, data, model and, for the same decoder, trained options; checked
before any work); its row is scored under the comparison's settings like every other row. Then speed
is measured for all of them in this one process, with the same thread count, after a warm-up,
interleaving the decoders and taking the median of `--repeats` passes: examples per second at batch
size 1 and at `eval.batch_size`, timing only `generate` (encoder + decoder calls) on batches
prepared beforehand. Timing runs on the device the trainer settings give (`trainer.accelerator`,
`trainer.devices`), with denormal floats flushed to zero on a CPU. Peak memory is taken in a
separate pass at the eval batch size (CUDA: max allocated; CPU: the C heap in use, sampled every
millisecond), over its level before the decode. The device and the flushing are recorded with the
results. Writes FILE.json, FILE.md and two plots next to them (and, per swept option, quality and
speedup against its value), and a summary run to MLflow, all tagged with one comparison id.
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
    training: str = "own"                                  # `training_label`
    fit_seconds: float | None = None                       # its training here (None: --ckpt, shared)

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


# --backbone: where the decoders that can build on a trained sequential model get their backbone.
BACKBONES = ("from-sequential", "own")


def user_sets(key: str, config_file: str | None, overrides: list[str],
              sweeps: dict[str, list[str]]) -> bool:
    """Whether the command line (an override or a sweep) or the --config file sets `key`, to any
    value, null included: what the user chose wins over the defaults the comparison picks."""
    if key in sweeps or any(o.partition("=")[0] == key for o in overrides):
        return True
    unset = object()
    return config_file is not None and OmegaConf.select(OmegaConf.load(config_file), key,
                                                        default=unset) is not unset


def on_sequential(planned: list[tuple[DictConfig, list[str]]], backbone: str,
                  checkpoints: dict[str, str], user_set) -> list[bool]:
    """Per row, whether it trains on the backbone of the comparison's sequential row: its tested
    checkpoint becomes the row's `train.init_from` once that row is trained or loaded.

    Stern et al. add proposal heads to a trained model and keep its greedy output exact, so with
    a sequential row in the plan a decoder that `builds_on_sequential` starts from it, and where it
    has `freeze_backbone` that is set in its config (here, so that a --ckpt row is checked against
    it too): its quality is the sequential row's by construction. `backbone="own"` trains those
    that can train a backbone (blockwise: base head jointly with the heads) from scratch instead.
    A setting of `train.init_from` or `decoder.freeze_backbone` the user made (`user_set(key)`)
    wins. A decoder that `needs_trained_backbone` and gets none is refused here, before any work."""
    has_sequential = any(cfg.decoder.name == "sequential" for cfg, _ in planned)
    starts = []
    for cfg, _ in planned:
        kind = decoder_class(cfg.decoder.name)
        builds = has_sequential and not user_set("train.init_from") and (
            kind.needs_trained_backbone or (kind.builds_on_sequential and backbone == "from-sequential"))
        if builds and "freeze_backbone" in cfg.decoder and not user_set("decoder.freeze_backbone"):
            cfg.decoder.freeze_backbone = True
        loaded = cfg.decoder.name in checkpoints
        if kind.needs_trained_backbone and not (builds or loaded or cfg.train.init_from):
            raise ConfigError(f"decoder {cfg.decoder.name} trains on a trained sequential model's "
                              f"backbone, and this comparison gives it none: add sequential to "
                              f"--decoders (it then starts from that row's checkpoint), or set "
                              f"train.init_from=<a sequential checkpoint>")
        starts.append(builds and not loaded)  # a --ckpt row was trained already
    return starts


def training_label(cfg: DictConfig, from_sequential: bool, loaded: bool) -> str:
    """How a row's model was trained, for the table: `checkpoint` (--ckpt), `own` (from scratch),
    `joint` (from scratch, by a decoder that could have built on a sequential model instead:
    blockwise's base head trained with its heads), else where its backbone came from and whether it
    stayed frozen."""
    if loaded:
        return "checkpoint"
    kind = decoder_class(cfg.decoder.name)
    if not from_sequential and cfg.train.init_from is None:
        return "joint" if kind.builds_on_sequential else "own"
    source = "sequential backbone" if from_sequential else "train.init_from backbone"
    frozen = kind.needs_trained_backbone or cfg.decoder.get("freeze_backbone", False)
    return f"frozen {source}" if frozen else f"{source}, fine-tuned"


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


def trained_parameters(module: GenerationTask) -> int:
    """Weights a fit of this decoder trains: its own modules, plus the backbone unless frozen. A
    decoder on a frozen sequential backbone costs this on top of the sequential model's training."""
    count = sum(p.numel() for p in module.decoder.parameters())
    if module.decoder.trains_backbone():
        count += sum(p.numel() for p in module.backbone.parameters())
    return count


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
            "training": row.training,
            "trained_parameters": trained_parameters(row.module),
            "fit_seconds": row.fit_seconds,
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

    head = ["decoder", "training", *shown, "ex/s bs1", "ex/s batch", "speedup bs1", "speedup batch",
            "calls/ex", "reference calls/ex", "tokens/call", "bound hits", "peak MB", "trained params",
            "fit s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["label"], r["training"], *(fmt(r["quality"][k]) for k in shown),
                 fmt(r["examples_per_second_bs1"], 1), fmt(r["examples_per_second_batch"], 1),
                 fmt(r["speedup_bs1"], 2), fmt(r["speedup_batch"], 2),
                 fmt(r["decoder_calls_per_example"], 1), fmt(r["reference_calls_per_example"], 1),
                 fmt(r["tokens_per_call"], 2),
                 f"{r['bound_hits']} ({fmt(r['bound_hit_fraction'], 3)})",
                 fmt(r["peak_memory_mb"], 1), f"{r['trained_parameters']:,}",
                 fmt(r["fit_seconds"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    flushed = ", denormals flushed to zero" if result["flush_denormal"] else ""
    caption = (f"{result['task']} on {result['data']}, model {result['model']}, {result['device']}, "
               f"{result['threads']} threads{flushed}, eval batch {result['eval_batch_size']}; "
               f"memory = {result['memory']}")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def sweep_series(rows: list[Row], entries: list[dict], option: str,
                 primary: str) -> dict[str, dict[str, list]]:
    """What the plot of a swept decoder option shows: per series (a decoder, with the values of
    its other swept options) the option's values in the plan's order (`x`) and, at each, the
    `primary` quality metric and the speedups over sequential (None without a sequential row).
    `entries` are `report`'s rows, in the order of `rows`."""
    series: dict[str, dict[str, list]] = {}
    for row, entry in zip(rows, entries):
        if option not in row.swept:
            continue
        points = series.setdefault(row_label(row.cfg, [k for k in row.swept if k != option]),
                                   {"x": [], "quality": [], "speedup_bs1": [], "speedup_batch": []})
        value = row.cfg.decoder[option]
        # numbers on a numeric axis; anything else (a flag) as categories
        points["x"].append(value if isinstance(value, (int, float)) and not isinstance(value, bool)
                           else str(value))
        points["quality"].append(entry["quality"][primary])
        for key in ("speedup_bs1", "speedup_batch"):
            points[key].append(entry[key])
    return series


def plot_sweep(series: dict[str, dict[str, list]], option: str, primary: str,
               reference_quality: float | None, batch_size: int, path: Path) -> None:
    """`sweep_series` drawn: quality against the option's value, with sequential's as a grey line,
    and beside it (when there is a sequential row) the speedup over sequential at batch size 1
    (solid) and at `batch_size` (dashed)."""
    plt = pyplot()
    panels = 1 if reference_quality is None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    quality = axes[0][0]
    for label, points in series.items():
        line, = quality.plot(points["x"], points["quality"], marker="o", label=label)
        if panels == 2:
            axes[0][1].plot(points["x"], points["speedup_bs1"], marker="o", color=line.get_color(),
                            label=f"{label}, batch size 1")
            axes[0][1].plot(points["x"], points["speedup_batch"], marker="s", ls="--",
                            color=line.get_color(), label=f"{label}, batch size {batch_size}")
    if panels == 2:
        quality.axhline(reference_quality, color="grey", lw=0.8, label="sequential")
        speedup = axes[0][1]
        speedup.axhline(1.0, color="grey", lw=0.8)
        speedup.set_xlabel(option)
        speedup.set_ylabel("speedup over sequential")
        speedup.legend()
    if all(isinstance(x, int) for points in series.values() for x in points["x"]):
        from matplotlib.ticker import MaxNLocator
        for ax in axes[0]:  # no ticks between integer settings (delay 1.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    quality.set_xlabel(option)
    quality.set_ylabel(primary)
    quality.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(rows: list[Row], result: dict, stem: Path) -> list[Path]:
    plt = pyplot()
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

    reference_quality = None if reference is None else reference.quality[primary]
    for option in dict.fromkeys(option for row in rows for option in row.swept):
        paths.append(stem.with_name(f"{stem.name}_vs_{option}.png"))
        plot_sweep(sweep_series(rows, result["rows"], option, primary), option, primary,
                   reference_quality, result["eval_batch_size"], paths[-1])
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
    parser.add_argument("--backbone", choices=BACKBONES, default="from-sequential",
                        help="from-sequential: with sequential in --decoders, decoders that can "
                             "build on a trained sequential model (blockwise, onestep) train on its "
                             "checkpoint's backbone, frozen, as Stern et al.; own: they train their "
                             "own where they can (blockwise: base head jointly with the heads)")
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
    sweeps = parse_sweeps(args.sweep)
    planned = plan(args.task, decoders, args.config, args.overrides, sweeps)
    starts = on_sequential(planned, args.backbone, checkpoints,
                           lambda key: user_sets(key, args.config, args.overrides, sweeps))
    cfgs = [cfg for cfg, _ in planned]
    if args.print_config:
        for cfg, start in zip(cfgs, starts):
            if start:
                print("# train.init_from: the sequential row's checkpoint, once trained or loaded")
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
    trained: dict[str, tuple[Built, str]] = {}  # training key -> the model and its checkpoint
    sequential_checkpoint = None
    rows: list[Row | None] = [None] * len(planned)
    # the rows that start from the sequential row's checkpoint after it; the table keeps the plan's order
    for index in sorted(range(len(planned)), key=lambda i: starts[i]):
        cfg, swept = planned[index]
        name = cfg.decoder.name
        if starts[index]:
            cfg.train.init_from = sequential_checkpoint
        training = training_label(cfg, starts[index], name in checkpoints)
        row_tags = {**tags, "training": training}
        key = training_key(cfg)
        if key in trained:
            row = score_row(cfg, with_decoder(cfg, trained[key][0]), row_tags)
        elif name in checkpoints:
            trained[key] = restore(loaded[name], checkpoints[name], cfg), checkpoints[name]
            row = score_row(cfg, trained[key][0], {**row_tags, "checkpoint": checkpoints[name]})
        else:
            log.info("training %s (%s)", name, training)
            result = train_and_test(cfg, tags=row_tags)
            trained[key] = result.built, result.checkpoint
            row = Row(cfg, result.built.module, result.built.datamodule, result.logger)
            row.fit_seconds = result.fit_seconds
        if name == "sequential" and sequential_checkpoint is None:
            sequential_checkpoint = trained[key][1]
        row.swept = swept
        row.training = training
        row.quality = dict(row.module.quality_scores)
        row.telemetry = dict(row.module.test_scores)
        rows[index] = row

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
