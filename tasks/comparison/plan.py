"""A comparison's plan: the command line's decoders, sweeps and checkpoints, one resolved
configuration per row, where each row's model comes from (trained, on the sequential row's
backbone, or a --ckpt checkpoint checked against its row), and `Row`, what is known of a row."""
from __future__ import annotations

import json
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from decoders import decoder_class
from tasks.config import ConfigError, compose
from tasks.module import Evaluation, GenerationTask
from tasks.runs.checkpoints import config_differences, is_model_key
from tasks.runs.trainer import decoder_options, needs_trained_backbone
from tasks.runs.restore import check_decoder


@dataclass(frozen=True)
class Row:
    """A fitted (or loaded) and tested row: its configuration, its model and data, its MLflow run,
    its test pass, and how it came to be."""
    cfg: DictConfig
    module: GenerationTask
    datamodule: object
    logger: object
    tested: Evaluation                # its test pass
    swept: list[str]                  # options this row's sweep set
    training: str                     # `training_label`
    fit_seconds: float | None         # its training here (None: --ckpt, shared, trains nothing)
    wall_seconds: float               # its training and test in this process

    @property
    def options(self) -> dict:
        return decoder_options(self.cfg)

    @property
    def label(self) -> str:
        return row_label(self.cfg, self.swept)


def row_label(cfg: DictConfig, swept: list[str]) -> str:
    """The decoder's name, with the values of the options its sweep set: `nar(iterations=2)`."""
    return settings_label(cfg.decoder.name, {key: cfg.decoder[key] for key in swept})


def settings_label(name: str, settings: dict) -> str:
    """A decoder's `name` with decoder `settings` (option -> value), as row labels write them."""
    written = ",".join(f"{key}={'null' if value is None else value}" for key, value in settings.items())
    return f"{name}({written})" if written else name


def swept_options(label: str) -> list[str]:
    """The decoder options a row's label (`row_label`) names, in its order."""
    return [setting.split("=", 1)[0].removeprefix("decoder.") for setting in row_settings(label)[1]]


def row_settings(label: str) -> tuple[str, list[str]]:
    """`row_label`'s inverse: `nar(iterations=2,length_candidates=3)` -> ("nar",
    ["decoder.iterations=2", "decoder.length_candidates=3"]) (configuration overrides, checked
    where they are applied); a plain name -> (name, [])."""
    name, _, settings = label.partition("(")
    if settings and not settings.endswith(")"):
        raise ConfigError(f"{label!r}: expected NAME or NAME(OPTION=VALUE,...), e.g. "
                          f"aggressive(redraft=outgrown)")
    pairs = [item for item in settings[:-1].split(",") if item]
    if any("=" not in pair for pair in pairs):
        raise ConfigError(f"{label!r}: each setting is OPTION=VALUE, e.g. aggressive(redraft=outgrown)")
    return name, [f"decoder.{pair.strip()}" for pair in pairs]


def parse_decoders(text: str) -> list[str]:
    """`--decoders a,b,c` -> names; an unknown name fails here, listing the registered ones, and so
    does a name given twice."""
    decoders = [d.strip() for d in text.split(",") if d.strip()]
    if not decoders:
        raise ConfigError(f"--decoders {text!r} names no decoder")
    for name in decoders:
        try:
            decoder_class(name)
        except ValueError as err:
            raise ConfigError(f"--decoders: {err}") from err
    repeated = sorted({name for name in decoders if decoders.count(name) > 1})
    if repeated:  # two rows of one decoder and options would share a label, a table row, a metric key
        raise ConfigError(f"--decoders {text!r} names {', '.join(repeated)} more than once; to "
                          f"compare one decoder's settings, use --sweep decoder.OPTION=v1,v2")
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
    """`--ckpt NAME=PATH` items -> {NAME: PATH}, each NAME once (and one of `names`, if given). A
    NAME may carry decoder settings as `row_label` writes them, `aggressive(redraft=outgrown)`: the
    `=` inside its parentheses is not the one before the path."""
    checkpoints: dict[str, str] = {}
    for item in items:
        opening = item.find("(")
        settings_end = item.find(")", opening) + 1 if 0 <= opening < item.find("=") else 0
        name, equals, path = item[settings_end:].partition("=")
        name = item[:settings_end] + name
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
    wins. A decoder that `needs_trained_backbone`, or is set to freeze its backbone, and gets none
    is refused here, before any work. A decoder that trains nothing decodes the sequential row's
    model (`decodes_sequential_row`)."""
    has_sequential = any(cfg.decoder.name == "sequential" for cfg, _ in planned)
    starts = []
    for cfg, _ in planned:
        kind = decoder_class(cfg.decoder.name)
        if kind.trains_nothing:
            starts.append(decodes_sequential_row(cfg, has_sequential, cfg.decoder.name in checkpoints))
            continue
        builds = has_sequential and not user_set("train.init_from") and (
            kind.needs_trained_backbone or (kind.builds_on_sequential and backbone == "from-sequential"))
        if builds and "freeze_backbone" in cfg.decoder and not user_set("decoder.freeze_backbone"):
            cfg.decoder.freeze_backbone = True
        loaded = cfg.decoder.name in checkpoints
        needs = needs_trained_backbone(cfg)
        if needs and not (builds or loaded or cfg.train.init_from):
            raise ConfigError(f"{needs} trains on a trained sequential model's backbone, and this "
                              f"comparison gives it none: add sequential to "
                              f"--decoders (it then starts from that row's checkpoint), or set "
                              f"train.init_from=<a sequential checkpoint>")
        starts.append(builds and not loaded)  # a --ckpt row was trained already
    return starts


def decodes_sequential_row(cfg: DictConfig, has_sequential: bool, loaded: bool) -> bool:
    """Whether the row of a decoder that trains nothing (`Decoder.trains_nothing`) decodes the
    model of the comparison's sequential row: it does, unless a --ckpt checkpoint is its model. With
    neither, the row has no model to decode: refused here, before any work."""
    name = cfg.decoder.name
    if not (has_sequential or loaded):
        raise ConfigError(f"decoder {name} trains nothing: it decodes a trained sequential model, and "
                          f"this comparison gives it none: add sequential to --decoders (it then "
                          f"decodes that row's model), or give it a sequential checkpoint with "
                          f"--ckpt {name}=PATH")
    return not loaded


def check_drafters(planned: list[tuple[DictConfig, list[str]]], user_set) -> None:
    """A decoder that drafts with another decoder's model (`Decoder.drafts_with`: aggressive with
    nar's) drafts, in a comparison, with the tested checkpoint of that decoder's row (the first such
    row, where a sweep makes several): the plan must have one, and `decoder.drafter` is the
    comparison's to set, not the user's (`user_set(key)`). Refused here, before any work."""
    names = {cfg.decoder.name for cfg, _ in planned}
    for cfg, _ in planned:
        name, drafts_with = cfg.decoder.name, decoder_class(cfg.decoder.name).drafts_with
        if drafts_with is None:
            continue
        reuse = f"--ckpt {drafts_with}={drafts_with.upper()}_CKPT reuses a trained one"
        if user_set("decoder.drafter"):
            raise ConfigError(f"decoder.drafter: in tasks.compare decoder {name} drafts with the "
                              f"{drafts_with} row's model; add {drafts_with} to --decoders ({reuse}) "
                              f"instead of setting decoder.drafter")
        if drafts_with not in names:
            raise ConfigError(f"decoder {name} drafts with a {drafts_with} model, and this comparison "
                              f"has none: add {drafts_with} to --decoders (its row's model then "
                              f"drafts; {reuse})")


def training_label(cfg: DictConfig, from_sequential: bool, loaded: bool) -> str:
    """How a row's model was trained, for the table: `checkpoint` (--ckpt), `own` (from scratch),
    `joint` (from scratch, by a decoder that could have built on a sequential model instead:
    blockwise's base head trained with its heads), `none: sequential model` (a decoder that trains
    nothing, on the sequential row's model; aggressive adds its drafter), else where its backbone
    came from and whether it stayed frozen."""
    if loaded:
        return "checkpoint"
    kind = decoder_class(cfg.decoder.name)
    if kind.trains_nothing:
        drafter = f", {kind.drafts_with} row's drafter" if kind.drafts_with else ""
        return f"none: sequential model{drafter}"
    if not from_sequential and cfg.train.init_from is None:
        return "joint" if kind.builds_on_sequential else "own"
    source = "sequential backbone" if from_sequential else "train.init_from backbone"
    frozen = kind.needs_trained_backbone or cfg.decoder.get("freeze_backbone", False)
    return f"frozen {source}" if frozen else f"{source}, fine-tuned"


def training_key(cfg: DictConfig) -> str:
    """Rows that differ only in decode-time options share one trained model."""
    decode_only = decoder_class(cfg.decoder.name).decode_only_options()
    trained = {k: v for k, v in cfg.decoder.items() if k not in decode_only}
    rest = {k: v for k, v in cfg.items() if k != "decoder"}
    return json.dumps([trained, OmegaConf.to_container(OmegaConf.create(rest), resolve=True)],
                      sort_keys=True, default=str)


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
    decode_only = decoder_class(cfg.decoder.name).decode_only_options()

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
