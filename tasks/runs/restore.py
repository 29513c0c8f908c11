"""Restoring what `tasks.fit` saved: a checkpoint's configuration with overrides, checked against
the decoder asked for (`checkpoint_config`), then its data, model and decoder with its weights
(`restore`), or the model and decoder alone from the checkpoint's stored tokenizer
(`restore_module`), and the nar drafter of a decoder that drafts with one (`attach_drafter`).
Every command that decodes a checkpoint restores it through here, and a checkpoint of the
sequential layout leaves through here as a `save_pretrained` folder (`save_pretrained_folder`)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from transformers import GenerationConfig

from decoders import available, decoder_class
from tasks.config import ConfigError, compose
from tasks.module import GenerationTask
from tasks.runs.checkpoints import load_checkpoint, stored_model, trained_decoder
from tasks.runs.trainer import build, build_module


def checkpoint_config(checkpoint: dict, path: str, overrides: list[str], config_file: str | None = None):
    if "pretraining" in checkpoint:   # written by tasks.experiments.pretrain: a backbone, trained for no task
        raise ConfigError(f"checkpoint {path} is a tasks.experiments.pretrain backbone "
                          f"({checkpoint['pretraining'].get('objective', 'denoising')}), trained for "
                          f"no task: fit a decoder from it with `python -m tasks.fit --task TASK "
                          f"--decoder DECODER train.init_from={path}`, then test that fit's checkpoint")
    stored = checkpoint["hyper_parameters"]["cfg"]
    cfg = compose(None, None, config_file, overrides, base=stored)
    for group, key in (("task", "name"), ("model", "name")):
        if cfg[group][key] != stored[group][key]:
            raise ConfigError(f"checkpoint {path} was trained for {group} {stored[group][key]!r}; "
                              f"it cannot be used as {group} {cfg[group][key]!r}")
    check_decoder(checkpoint, path, cfg.decoder.name)
    if decoder_class(cfg.decoder.name).drafts_with:
        drafter_checkpoint(cfg, checkpoint)  # refused here, before any work, if it cannot draft
    return cfg


def drafter_checkpoint(cfg, verifier: dict) -> dict:
    """The checkpoint `decoder.drafter` names for a decoder that drafts with another decoder's model
    (`Decoder.drafts_with`: aggressive drafts with nar's), verifying with the checkpoint `verifier`:
    one trained with that decoder, with the verifier's tokenizer, else ConfigError."""
    path, name = cfg.decoder.drafter, cfg.decoder.name
    drafts_with = decoder_class(name).drafts_with
    if path is None:
        raise ConfigError(f"decoder={name} needs a drafter: set decoder.drafter="
                          f"{drafts_with.upper()}_CKPT, a checkpoint written by tasks.fit --decoder "
                          f"{drafts_with}")
    drafter = load_checkpoint(path)
    trained_with = trained_decoder(drafter)
    if trained_with != drafts_with:
        raise ConfigError(f"decoder.drafter={path} was trained with decoder {trained_with!r}; the "
                          f"{name} decoder drafts with a {drafts_with} checkpoint")
    if tokenizer_identity(drafter) != tokenizer_identity(verifier):
        raise ConfigError(f"decoder.drafter={path} has another tokenizer than the checkpoint it "
                          f"drafts for; a drafter and its verifier must share one")
    return drafter


def tokenizer_identity(checkpoint: dict):
    """What identifies a checkpoint's tokenizer: the tokenizer it stores, or else (a pretrained
    model's, loaded again by name) the model's name."""
    if checkpoint.get("tokenizer_json") is not None:
        return checkpoint["tokenizer_json"], checkpoint.get("tokenizer_settings")
    return checkpoint["hyper_parameters"]["cfg"]["model"]["name"]


def attach_drafter(module: GenerationTask, cfg, verifier: dict) -> None:
    """The drafter of a decoder that drafts with another decoder's model (`Decoder.drafts_with`),
    restored from `decoder.drafter` and attached to it, for the module's backbone as verifier;
    nothing for the other decoders."""
    if not decoder_class(cfg.decoder.name).drafts_with:
        return
    path = cfg.decoder.drafter
    drafter = drafter_checkpoint(cfg, verifier)
    nar = restore_module(drafter, path, checkpoint_config(drafter, path, []))
    module.decoder.attach_drafter(nar.decoder, nar.backbone, verifier=module.backbone)


def check_decoder(checkpoint: dict, path: str, decoder: str) -> None:
    """Refuse to decode `checkpoint` with `decoder` where that decoder's layout is not the one the
    checkpoint's decoder trained the backbone on."""
    trained_name = trained_decoder(checkpoint)
    trained = decoder_class(trained_name)
    if not decoder_class(decoder).can_decode_checkpoint_of(trained):
        others = [name for name in available()
                  if name != trained_name and decoder_class(name).can_decode_checkpoint_of(trained)]
        also = f", or another decoder of its layout: {', '.join(others)}" if others else ""
        raise ConfigError(f"checkpoint {path} was trained with decoder {trained_name!r}; decoder "
                          f"{decoder!r} cannot decode it (use decoder={trained_name}{also})")


def restore_as_trained(path: str):
    """`restore` of the checkpoint at `path` (loaded as data) with the configuration it was
    trained with, overriding nothing: what decode-only benchmarks time."""
    return restore_with_decoder(path)[1]


def restore_with_decoder(path: str, decoder: str | None = None, drafter: str | None = None,
                         settings: list[str] | None = None):
    """(configuration, `restore`'s result) of the checkpoint at `path`, decoded by `decoder` (one
    of the trained layout; None: the decoder it was trained with), drafting with the checkpoint
    `drafter` where that decoder drafts with another model, with the decode-time `settings`
    (`decoder.OPTION=VALUE` overrides)."""
    checkpoint = load_checkpoint(path)
    overrides = [] if decoder is None else [f"decoder={decoder}"]
    if drafter is not None and decoder is not None and decoder_class(decoder).drafts_with:
        overrides.append(f"decoder.drafter={drafter}")
    overrides += settings or []
    cfg = checkpoint_config(checkpoint, path, overrides)
    return cfg, restore(checkpoint, path, cfg)


def restore(checkpoint: dict, path: str, cfg):
    """Data, model and decoder for `cfg` (from `checkpoint_config`), with the checkpoint's weights
    (`load_weights`)."""
    built = build(cfg, stored_model(checkpoint))
    load_weights(built.module, checkpoint, path)
    attach_drafter(built.module, cfg, checkpoint)
    return built


def restore_module(checkpoint: dict, path: str, cfg) -> GenerationTask:
    """`restore`'s model and decoder, from the checkpoint alone: its stored tokenizer, no data read
    (what decodes new inputs, tasks.predict)."""
    stored = stored_model(checkpoint)
    if stored.tokenizer is None:
        raise ConfigError(f"checkpoint {path} carries no tokenizer; decode it with tasks.test, "
                          f"which loads one as its data is read")
    module = build_module(cfg, stored.tokenizer, stored.backbone_config)
    load_weights(module, checkpoint, path)
    attach_drafter(module, cfg, checkpoint)
    return module


def load_weights(module: GenerationTask, checkpoint: dict, path: str) -> None:
    """The checkpoint's weights into `module`. Weights of modules the chosen decoder lacks (e.g.
    blockwise heads when decoding sequentially) are ignored; every weight the model needs must be
    there."""
    try:
        missing, _ = module.load_state_dict(checkpoint["state_dict"], strict=False)
    except RuntimeError as err:  # shapes differ: an option that sizes a module was changed
        raise ConfigError(f"checkpoint {path} does not fit the configured model (was an option "
                          f"that sizes a module changed?): {str(err).splitlines()[-1].strip()}") from err
    if missing:
        raise ConfigError(f"checkpoint {path} lacks weights the model needs: {missing[:5]}")


# The decoder whose output the exported folder's `generate` reproduces, and whose layout a
# checkpoint must have been trained on.
EXPORTED_LAYOUT = "sequential"


def check_exportable(checkpoint: dict, path: str) -> None:
    """Refuse (ConfigError) a checkpoint whose model transformers' `generate` cannot decode."""
    trained = trained_decoder(checkpoint)
    if not decoder_class(EXPORTED_LAYOUT).can_decode_checkpoint_of(decoder_class(trained)):
        raise ConfigError(f"checkpoint {path} was trained with decoder {trained!r}, whose model "
                          f"transformers' generate cannot decode (it writes its output in another "
                          f"layout than one token after another); only a checkpoint of the "
                          f"sequential layout exports: sequential, blockwise")


def usable_out(out: Path) -> None:
    """Refuse (ConfigError) an `--out` folder that holds anything."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; give a new one")


def save_pretrained_folder(path: str, out: str) -> Path:
    """Write checkpoint `path`'s backbone and tokenizer to the folder `out`, as `save_pretrained`
    writes them, for a checkpoint of the sequential layout (`check_exportable`): transformers'
    greedy `generate` on it, given only the inputs, writes the sequential decoder's tokens (its
    generation configuration names the start, end and pad tokens and the output bound). `out` must
    be new or empty; it is written under a temporary name, then renamed (`tasks.export`)."""
    target = Path(out)
    usable_out(target)
    checkpoint = load_checkpoint(path)
    check_exportable(checkpoint, path)
    cfg = checkpoint_config(checkpoint, path, [f"decoder={EXPORTED_LAYOUT}"])
    module = restore_module(checkpoint, path, cfg)
    special = module.decoder.special
    backbone = module.backbone
    backbone.generation_config = GenerationConfig(
        decoder_start_token_id=special.start, eos_token_id=special.eos, pad_token_id=special.pad,
        max_new_tokens=int(cfg.decoder.max_new_tokens), do_sample=False, num_beams=1)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        backbone.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)
        if target.exists():
            target.rmdir()   # empty (`usable_out`)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
