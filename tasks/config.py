"""Configuration: `configs/default.yaml` + one file from each group + a YAML file + dotlist overrides.

Composition order (later wins):
    default.yaml -> task/<t>.yaml, decoder/<d>.yaml, model/<m>.yaml, data/<s>.yaml -> --config FILE -> overrides

A group is chosen with `group=name` (`model=t5-base`, `data=kp20k`), with `--task/--decoder` on the
command line, or through the key that names it (`task.name`, `decoder.name`, `model.name`,
`data.source`); a model is also chosen by its folder or hub id (`model=DIR`, `model.name=owner/name`:
`model=pretrained` with that `model.hub_id`). A single key is set with `group.key=value`. Everything is checked before any work:
unknown group names, unknown keys, values of the wrong type and values out of range (`VALUE_RANGES`,
each decoder's declared `options`, `trainer.devices`) raise `ConfigError` naming the key or value and
what is allowed.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from datamodules.vocabulary import Range

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
log = logging.getLogger("tasks")

# group -> the key inside the group that names the chosen file
GROUPS = {"task": "name", "decoder": "name", "model": "name", "data": "source"}
DEFAULT_CHOICES = {"task": "keyphrase", "decoder": "sequential", "model": "t5-tiny", "data": "builtin"}

# Keys whose value may take several types (everything else must keep its default's type).
UNION_TYPES: dict[str, tuple[type, ...]] = {
    "trainer.devices": (int, str, list),
    "trainer.precision": (int, str),
    "trainer.val_check_interval": (int, float),
    "trainer.gradient_clip_val": (int, float, type(None)),
}
# Trainer arguments that are objects, not configuration, or that the library sets itself
# (tasks.runs.trainer.make_trainer: its samplers keep DDP evaluation free of duplicates, its
# checkpoint writer is atomic, its callbacks checkpoint).
TRAINER_RESERVED = {"self", "logger", "callbacks", "plugins", "profiler", "default_root_dir",
                    "use_distributed_sampler", "enable_checkpointing", "enable_autolog_hparams"}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key/value and the allowed ones."""


def group_choices(group: str) -> list[str]:
    if group == "decoder":
        from decoders import available  # the registry is the only list of decoder names
        return available()
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _load_yaml(path: Path) -> DictConfig:
    try:
        return OmegaConf.create(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err


def _decoder_group(name: str) -> DictConfig:
    """A decoder's options: their defaults as the decoder declares them (`Decoder.options`), then
    its YAML file if it has one.

    Reading the defaults from the class means a new decoder needs no YAML file to be usable, and
    a YAML key the class does not accept is caught here.
    """
    from decoders import decoder_class
    options = decoder_class(name).defaults()
    cfg = OmegaConf.create({"name": name, **options})
    path = CONFIG_DIR / "decoder" / f"{name}.yaml"
    if path.exists():
        from_file = _load_yaml(path)
        unknown = set(from_file) - set(cfg)
        if unknown:
            raise ConfigError(f"{path} sets {sorted(unknown)}, which decoder {name!r} does not take; "
                              f"its options: {sorted(options)}")
        cfg = OmegaConf.merge(cfg, from_file)
    return cfg


def _group_config(group: str, choice: str) -> DictConfig:
    allowed = group_choices(group)
    if choice not in allowed:
        also = ", or a save_pretrained folder or hub id (a name with a '/')" if group == "model" else ""
        raise ConfigError(f"unknown {group} {choice!r}; allowed: {', '.join(allowed)}{also}")
    if group == "decoder":
        return _decoder_group(choice)
    return _load_yaml(CONFIG_DIR / group / f"{choice}.yaml")


def _parse_dotlist(overrides: Iterable[str]) -> tuple[dict[str, str], DictConfig]:
    """Split overrides into group choices (`model=t5-base`) and key settings (`a.b=1`)."""
    choices: dict[str, str] = {}
    settings: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        group, _, subkey = key.partition(".")
        if key in GROUPS or GROUPS.get(group) == subkey:
            choices[group] = value
            if group == "model" and "/" in value:   # a folder or a hub id: the pretrained group's
                choices[group] = "pretrained"
                settings.append(f"model.hub_id={value}")
        else:
            settings.append(item)
    try:
        return choices, OmegaConf.from_dotlist(settings)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides {settings}: {err}") from err


def _type_ok(key: str, default: Any, value: Any) -> bool:
    if value is None or default is None:
        return True
    allowed = UNION_TYPES.get(key)
    if allowed is None:
        if isinstance(default, bool):
            allowed = (bool,)
        elif isinstance(default, int):
            allowed = (int,)
        elif isinstance(default, float):
            allowed = (float, int)
        elif isinstance(default, (list, ListConfig)):
            allowed = (list, ListConfig)
        elif isinstance(default, (dict, DictConfig)):
            allowed = (dict, DictConfig)
        else:
            allowed = (type(default),)
    return isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)


def _check_against(base: DictConfig, update: DictConfig, origin: str, prefix: str = "") -> None:
    """Every key of `update` must exist in `base` with a value of the same type."""
    known = set(base.keys())  # not `key in base`: that is False for a required (???) value
    for key in update:
        path = f"{prefix}{key}"
        value = OmegaConf.to_container(update, resolve=False)[key]
        if path.startswith("trainer.") and key not in known:
            if key in TRAINER_RESERVED:
                raise ConfigError(f"{origin}: {path} is set by the library, not by configuration; "
                                  f"remove it")
            trainer_args = _trainer_arguments()
            if key not in trainer_args:
                raise ConfigError(f"{origin}: unknown key {path!r}; lightning.Trainer takes: "
                                  f"{', '.join(sorted(trainer_args))}")
            continue
        if key not in known:
            raise ConfigError(f"{origin}: unknown key {path!r}; allowed keys under "
                              f"{prefix[:-1] or 'the top level'}: {', '.join(sorted(map(str, base)))}")
        default = OmegaConf.to_container(base, resolve=False)[key]
        if isinstance(default, str) and default.startswith("${"):
            default = base[key]  # an interpolated default: the value it resolves to gives the type
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{origin}: {path!r} is a group of keys ({', '.join(default)}), "
                                  f"not a value; got {value!r}")
            _check_against(base[key], update[key], origin, prefix=f"{path}.")
        elif isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation: its type is checked once resolved
        elif not _type_ok(path, default, value):
            raise ConfigError(f"{origin}: {path}={value!r} has type {type(value).__name__}, "
                              f"but {path} takes {type(default).__name__} (default: {default!r})")


def _trainer_arguments() -> set[str]:
    from lightning import Trainer
    return set(inspect.signature(Trainer.__init__).parameters) - TRAINER_RESERVED


def compose(task: str | None = None, decoder: str | None = None, config_file: str | None = None,
            overrides: Iterable[str] = (), base: dict | None = None) -> DictConfig:
    """Build, check and resolve the configuration of one run.

    `base` is a stored, resolved configuration (a checkpoint's) to start from instead of the
    defaults: its group choices stand unless chosen again, and a re-chosen group keeps the base's
    values of the keys that `default.yaml` gives every choice of that group.
    """
    if config_file and not Path(config_file).exists():
        raise ConfigError(f"--config file {config_file} does not exist")
    choices, settings = _parse_dotlist(overrides)
    from_file = _load_yaml(Path(config_file)) if config_file else OmegaConf.create({})
    _refuse_renamed(settings, "override")
    _refuse_renamed(from_file, f"--config {config_file}")
    if base is not None:
        base = _with_position_heads(_with_current_names(base))

    defaults = _load_yaml(CONFIG_DIR / "default.yaml")
    cfg = defaults if base is None else _with_todays_defaults(defaults, OmegaConf.create(base))
    before = {g: OmegaConf.select(cfg, f"{g}.{k}") for g, k in GROUPS.items()}
    # The group choice: command-line flag, else dotlist, else the --config file, else as before.
    picked = {g: before[g] or DEFAULT_CHOICES[g] for g in GROUPS}
    for group, key in GROUPS.items():
        if OmegaConf.select(from_file, f"{group}.{key}") is not None:
            picked[group] = OmegaConf.select(from_file, f"{group}.{key}")
    picked.update(choices)
    if task is not None:
        picked["task"] = task
    if decoder is not None:
        picked["decoder"] = decoder

    for group in GROUPS:
        if picked[group] == before[group]:
            continue
        shared_keys = defaults.get(group, OmegaConf.create({}))
        shared = {k: cfg[group][k] if group in cfg and k in cfg[group] else shared_keys[k]
                  for k in shared_keys}
        cfg[group] = OmegaConf.merge(shared, _group_config(group, picked[group]))

    _check_against(cfg, from_file, f"--config {config_file}")
    _check_against(cfg, settings, "override")
    cfg = OmegaConf.merge(cfg, from_file, settings)
    for group, key in GROUPS.items():  # the chosen names win over any stray copy in a file
        cfg[group][key] = picked[group]

    try:
        OmegaConf.resolve(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve the configuration: {err}") from err
    if missing:
        raise ConfigError(f"required key(s) not set: {', '.join(missing)} "
                          f"(e.g. data=jsonl needs data.path=DIR)")
    _check_values(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _refuse_renamed(update: DictConfig, origin: str) -> None:
    """A decoder option set under a former name (`decoders.base.RENAMED_OPTIONS`) is refused,
    naming its name now."""
    from decoders.base import RENAMED_OPTIONS
    for old, new in RENAMED_OPTIONS.items():
        if OmegaConf.select(update, f"decoder.{old}") is not None:
            raise ConfigError(f"{origin}: decoder.{old} is now called decoder.{new}; set "
                              f"decoder.{new} instead")


def _with_current_names(stored: dict) -> dict:
    """A stored configuration (a checkpoint's) with the decoder options renamed since it was written
    under their names now, so that checkpoints written before a rename still load and decode; each
    rename is logged as a deprecation."""
    from decoders.base import RENAMED_OPTIONS
    decoder = dict(stored.get("decoder") or {})
    for old, new in RENAMED_OPTIONS.items():
        if old in decoder and new not in decoder:
            log.warning("the stored configuration names decoder.%s, which is now decoder.%s; read "
                        "as that (deprecated: checkpoints written now store decoder.%s)", old, new, new)
            decoder[new] = decoder.pop(old)
    return {**stored, "decoder": decoder} if "decoder" in stored else stored


def _with_position_heads(stored: dict) -> dict:
    """A stored t5-tiny configuration written before `model.position_heads` existed, with none:
    its model was initialised without them (today's default may name more heads than it has)."""
    model = stored.get("model") or {}
    if model.get("name") != "t5-tiny" or "position_heads" in model:
        return stored
    return {**stored, "model": {**model, "position_heads": {"encoder": [], "decoder": []}}}


def _with_todays_defaults(defaults: DictConfig, stored: DictConfig) -> DictConfig:
    """A stored configuration, with the keys added to the library since it was written filled with
    their defaults (for the stored group choices), so that older checkpoints stay usable."""
    fresh = defaults.copy()
    for group, key in GROUPS.items():
        fresh[group] = OmegaConf.merge(defaults.get(group, OmegaConf.create({})),
                                       _group_config(group, OmegaConf.select(stored, f"{group}.{key}")))
    return OmegaConf.merge(fresh, stored)


# The allowed values of the numeric keys outside the decoder group (each decoder states its own
# options' allowed values: `Decoder.options`). A key a configuration does not have (model sizes with a
# pretrained model, Trainer arguments left to Lightning's defaults) is not checked.
VALUE_RANGES: dict[str, Range] = {
    "seed": Range(ge=0, le=2 ** 32 - 1, note="the seeds NumPy accepts"),
    "task.max_epochs": Range(ge=-1, note="-1: no limit"),  # the default of trainer.max_epochs
    "task.builtin_train_size": Range(ge=1),            # the default of data.train_size (builtin)
    "task.attention_heads.count": Range(ge=1),        # the defaults of t5-tiny's model.num_heads
    "task.attention_heads.dimensions": Range(ge=1),   # and model.d_kv
    "task.decoder_layers": Range(ge=1),               # and model.num_decoder_layers
    "task.feed_forward_width": Range(ge=1),           # and model.d_ff
    "train.batch_size": Range(ge=1),
    "model.lr": Range(gt=0, integer=False),  # the default of train.lr
    "train.lr": Range(gt=0, integer=False),
    "train.weight_decay": Range(ge=0, integer=False),
    "train.warmup_steps": Range(ge=0, note="0: no warm-up"),
    "task.lr_decay": Range(ge=0, le=1, integer=False),  # the default of train.lr_decay
    "train.lr_decay": Range(ge=0, le=1, integer=False, note="0: a constant rate after warm-up"),
    "train.position_bias_lr_scale": Range(gt=0, integer=False),
    "eval.batch_size": Range(ge=1),
    "eval.speed_batch_size": Range(ge=1),
    "data.max_train_examples": Range(ge=1, optional=True, note="null: all"),
    "data.max_eval_examples": Range(ge=1, optional=True, note="null: all"),
    "data.max_source_length": Range(ge=2, note="room for one token and the end token"),
    "data.max_target_length": Range(ge=2, note="room for one token and the end token"),
    "data.max_subsequences": Range(ge=1),
    "data.max_subsequence_length": Range(ge=2, note="room for one token and the end token"),
    "data.num_workers": Range(ge=0),
    "data.train_size": Range(ge=1),
    "data.validation_size": Range(ge=1),
    "data.test_size": Range(ge=1),
    "data.corpus_seed": Range(ge=0),
    "model.vocab_size": Range(ge=1),
    "model.d_model": Range(ge=1),
    "model.d_ff": Range(ge=1),
    "model.d_kv": Range(ge=1),
    "model.num_heads": Range(ge=1),
    "model.num_layers": Range(ge=1),
    "model.num_decoder_layers": Range(ge=1),
    "model.dropout": Range(ge=0, lt=1, integer=False),
    "model.initializer_factor": Range(gt=0, integer=False),
    "model.init_std": Range(gt=0, integer=False),
    "model.max_positions": Range(ge=1),
    # Lightning's own limits, checked here so that a bad one fails before the data is read
    "trainer.max_epochs": Range(ge=-1, optional=True, note="-1: no limit"),
    "trainer.min_epochs": Range(ge=0, optional=True),
    "trainer.max_steps": Range(ge=-1, note="-1: no limit"),
    "trainer.min_steps": Range(ge=0, optional=True),
    "trainer.num_nodes": Range(ge=1),
    "trainer.accumulate_grad_batches": Range(ge=1),
    "trainer.gradient_clip_val": Range(ge=0, integer=False, optional=True),
    "trainer.log_every_n_steps": Range(ge=0, optional=True, note="0: no logging within epochs"),
    "trainer.check_val_every_n_epoch": Range(ge=1, optional=True),
    "trainer.num_sanity_val_steps": Range(ge=-1, optional=True, note="-1: the whole validation split"),
}
_ABSENT = object()


def _check_values(cfg: DictConfig) -> None:
    """Value ranges that the type check cannot see: `VALUE_RANGES`, the decoder's
    declared `options`, `trainer.devices` and the named choices."""
    from datamodules.schema import TASKS
    from decoders import decoder_class
    if cfg.task.name not in TASKS:
        raise ConfigError(f"unknown task {cfg.task.name!r}; allowed: {', '.join(TASKS)}")
    from decoders.backbone import STRUCTURED_ATTENTION
    for key in ("task.attention_implementation", "model.attn_implementation"):  # the task's default first
        if (value := OmegaConf.select(cfg, key)) not in STRUCTURED_ATTENTION:
            raise ConfigError(f"{key}={value!r}; allowed: {', '.join(STRUCTURED_ATTENTION)}")
    if cfg.task.name == "qa" and cfg.task.level not in ("phrase", "sentence"):
        raise ConfigError(f"task.level={cfg.task.level!r}; allowed: phrase, sentence")
    for key, allowed in VALUE_RANGES.items():
        group, _, name = key.rpartition(".")
        siblings = OmegaConf.select(cfg, group) if group else cfg   # group: a dotted path
        value = _ABSENT if siblings is None else siblings.get(name, _ABSENT)
        problem = None if value is _ABSENT else allowed.problem(key, value, siblings)
        if problem is not None:
            raise ConfigError(problem)
    problem = _devices_problem(cfg.trainer.get("devices", "auto"))
    if problem is not None:
        raise ConfigError(problem)
    problem = _position_heads_problem(cfg.model) or _model_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)
    options = {k: v for k, v in cfg.decoder.items() if k != "name"}
    problem = decoder_class(cfg.decoder.name).options_problem(options)
    if problem is not None:
        raise ConfigError(problem)


def _model_problem(cfg: DictConfig) -> str | None:
    """A pretrained model needs a folder or hub id; a model built here of a BART-like type
    (`model.type`) a type one is built as, heads that split d_model evenly, and positions for the
    longest source and output."""
    model = cfg.model
    if "hub_id" in model and model.hub_id is None:
        return (f"model={model.name} needs model.hub_id: a folder that save_pretrained wrote or a "
                f"hub id")
    if "hub_id" in model or "type" not in model:
        return None
    from tasks.models import BUILT_CONFIGS
    types = ("t5", *BUILT_CONFIGS)
    if model.type not in types:
        return f"model.type={model.type!r}; models are built here of these types: {', '.join(types)}"
    if model.type == "t5":
        return None
    if model.d_model % model.num_heads:
        return (f"model.d_model={model.d_model} is not split evenly by model.num_heads="
                f"{model.num_heads}: a {model.type} head has d_model / num_heads dimensions")
    longest = max(cfg.data.max_source_length, cfg.data.max_target_length)
    if model.max_positions < longest:
        return (f"model.max_positions={model.max_positions} is fewer than the longest source or "
                f"output (data.max_source_length={cfg.data.max_source_length}, "
                f"data.max_target_length={cfg.data.max_target_length}); set it to at least {longest}")
    return None


def _position_heads_problem(model: DictConfig) -> str | None:
    """`model.position_heads` (t5-tiny's, `tasks.models.start_position_heads`): integer offsets, at
    most one per head, and none ahead of a decoder head's own output token."""
    if model.get("position_heads") is None:
        return None
    for side in ("encoder", "decoder"):
        key, offsets = f"model.position_heads.{side}", list(model.position_heads[side])
        if not all(isinstance(offset, int) and not isinstance(offset, bool) for offset in offsets):
            return f"{key} must be a list of integers (token offsets), got {offsets!r}"
        if len(offsets) > model.num_heads:
            return (f"{key} gives {len(offsets)} offsets, one per head, but model.num_heads is "
                    f"{model.num_heads}: {offsets!r}; set {key} to at most {model.num_heads} "
                    f"offsets, or [] for none")
        if side == "decoder" and any(offset > 0 for offset in offsets):
            return (f"{key} must be offsets <= 0 (a decoder head sees only earlier output tokens), "
                    f"got {offsets!r}")
    return None


def _devices_problem(devices: Any) -> str | None:
    """`trainer.devices` in a form Lightning takes: a count >= 1, -1 (all), "auto", or device
    indices (a list, or a string such as "0,1"). Whether the devices are there is for Lightning to
    say (`tasks.runs.trainer.check_trainer`)."""
    value = devices
    if isinstance(devices, str) and devices != "auto":
        try:
            numbers = [int(part) for part in devices.split(",") if part.strip()]
        except ValueError:
            numbers = []
        value = numbers if "," in devices else numbers[0] if numbers else None
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                           and (value >= 1 or value == -1)):
        return None
    if isinstance(value, (list, ListConfig)) and value and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value) \
            and len(set(value)) == len(value):
        return None
    return (f"trainer.devices must be a number of devices >= 1, -1 (all of them), 'auto', or a "
            f"non-empty list of distinct device indices >= 0 such as [0, 1], got {devices!r}")


def flatten(cfg: DictConfig) -> dict[str, Any]:
    """`{"a.b": value}` view of a config, for MLflow parameters."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
