"""Backbones: a small random T5 built from a config (offline) or a pretrained encoder–decoder of a
family the decoders run (`decoders.families`: T5, mT5, BART, mBART, Pegasus, Marian), from the hub
or from a local folder (`model.hub_id=DIR`)."""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from transformers import (AutoConfig, AutoModelForSeq2SeqLM, BartConfig, MarianConfig, MBartConfig,
                          PegasusConfig, PretrainedConfig, PreTrainedModel, T5Config,
                          T5ForConditionalGeneration)

from datamodules.tokenizer import built_here, built_type, pretrained_files
from decoders.families import family_of, running_model_types
from decoders.transformers_internals import (bias_owner, relative_position_buckets,
                                             set_attention_implementation)

# The relative-position bias a position head starts with at its offset (`start_position_heads`):
# exp(8) ~ 3000 times the weight of any other token, so that the head starts out reading
# nearly only that token in a source of a few hundred.
POSITION_HEAD_BIAS = 8.0


class ModelError(RuntimeError):
    """A backbone could not be built or loaded; the message says what to do instead."""


def check_pretrained_model_type(model: DictConfig) -> None:
    """Refuse (ModelError), before any data is read or any weight loaded, a pretrained model
    (`model.hub_id`) of a type no family of the decoders runs (`decoders.families`). Only its
    configuration is read."""
    if built_here(model):
        return
    with pretrained_files(model.hub_id, "the configuration of", ModelError) as name:
        config = AutoConfig.from_pretrained(name)
    if config.model_type not in running_model_types():
        built_as = ", ".join(config.architectures or []) or "no architecture named"
        raise ModelError(f"model.hub_id={model.hub_id!r} is a {config.model_type!r} model "
                         f"({built_as}); the decoders run these model types: "
                         f"{', '.join(running_model_types())}")


def build_backbone(model: DictConfig, tokenizer, stored_config: dict | None = None) -> PreTrainedModel:
    """The backbone `model` describes, for `tokenizer`. `stored_config` is the architecture a
    checkpoint carries (its backbone's configuration as a dict), for a backbone whose weights come
    from that checkpoint: a pretrained one is then built from it, without its folder or the hub."""
    # `model.attn_implementation` (sdpa by default, as in transformers: fused kernels on GPUs, or
    # eager): the decoders' own attention structures hold under both (decoders.backbone.run_decoder).
    if built_here(model) and built_type(model) != "t5":
        config = built_config(model, tokenizer)
        set_attention_implementation(config, model.attn_implementation)
        return AutoModelForSeq2SeqLM.from_config(config)
    if built_here(model):  # its architecture is the configuration's
        config = T5Config(vocab_size=len(tokenizer), d_model=model.d_model, d_ff=model.d_ff,
                          d_kv=model.d_kv, num_heads=model.num_heads, num_layers=model.num_layers,
                          num_decoder_layers=model.num_decoder_layers, dropout_rate=model.dropout,
                          initializer_factor=float(model.initializer_factor),
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.pad_token_id)
        set_attention_implementation(config, model.attn_implementation)
        backbone = T5ForConditionalGeneration(config)
        start_position_heads(backbone, list(model.position_heads.encoder),
                             list(model.position_heads.decoder))
        return backbone
    if stored_config is not None:  # random weights, replaced by the checkpoint's
        # checkpoints written before other families ran hold a T5's configuration without its type
        stored = {"model_type": "t5", **stored_config}
        config = AutoConfig.for_model(**stored)
        setattr(config, family_of(config).dropout_setting, model.dropout)
        set_attention_implementation(config, model.attn_implementation)
        backbone = AutoModelForSeq2SeqLM.from_config(config)
    else:
        check_pretrained_model_type(model)
        with pretrained_files(model.hub_id, "pretrained weights", ModelError) as name:
            config = AutoConfig.from_pretrained(name)
            dropout = {family_of(config).dropout_setting: model.dropout}
            backbone, loading = AutoModelForSeq2SeqLM.from_pretrained(
                name, attn_implementation=model.attn_implementation, output_loading_info=True,
                **dropout)
        new = sorted(loading["missing_keys"]) + sorted(loading["mismatched_keys"])
        if new:   # a weight not in the folder would decode from its random start
            raise ModelError(f"the weights of {model.hub_id!r} do not load whole into a "
                             f"{type(backbone).__name__}: {len(new)} missing or of another shape "
                             f"({', '.join(map(str, new[:4]))}{', ...' if len(new) > 4 else ''})")
    if len(tokenizer) > backbone.get_input_embeddings().num_embeddings:
        backbone.resize_token_embeddings(len(tokenizer))  # room for <sep> and <mask>
    return backbone


# The configurations of the BART-like types built here, the token each starts its decoder with
# (transformers' conventions: BART's and mBART's is the end token, Pegasus's and Marian's the pad),
# and whether it scales its token embeddings by sqrt(d_model): Pegasus's and Marian's checkpoints
# do, so that their tokens are not drowned by the sinusoidal positions (of norm sqrt(d_model / 2)).
BUILT_CONFIGS = {"bart": (BartConfig, "eos", False), "mbart": (MBartConfig, "eos", False),
                 "pegasus": (PegasusConfig, "pad", True), "marian": (MarianConfig, "pad", True)}


def built_config(model: DictConfig, tokenizer) -> PretrainedConfig:
    """The configuration of a BART-like model built here (`model.type`) at `model`'s sizes, for
    `tokenizer`'s special tokens; every decode-time extra of `generate` left unset."""
    config_class, start, scaled = BUILT_CONFIGS[built_type(model)]
    ids = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id}
    return config_class(
        vocab_size=len(tokenizer), d_model=model.d_model, encoder_layers=model.num_layers,
        decoder_layers=model.num_decoder_layers, encoder_attention_heads=model.num_heads,
        decoder_attention_heads=model.num_heads, encoder_ffn_dim=model.d_ff,
        decoder_ffn_dim=model.d_ff, max_position_embeddings=model.max_positions,
        dropout=model.dropout, init_std=float(model.init_std), pad_token_id=ids["pad"],
        eos_token_id=ids["eos"], bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=ids[start], forced_eos_token_id=None, scale_embedding=scaled)


def start_position_heads(backbone: T5ForConditionalGeneration, encoder: list[int],
                         decoder: list[int]) -> None:
    """Start some self-attention heads of a randomly initialised T5 attending by position: encoder
    head i to the source token `encoder[i]` places away (key position - query position: -1 the
    token before, 1 the token after), decoder head i to the output token `decoder[i]` places back
    (<= 0). Each such head's relative-position bias is `POSITION_HEAD_BIAS` at its offset's bucket
    and 0 at every other; the other heads keep T5's random init. Training then moves them as any
    other weight.

    Why: T5 sees positions only through that bias, one number per head and distance bucket shared
    by the stack's layers, which T5 initialises near 0, and no position reaches its cross-attention
    at all. A rule about what stands next to what (built-in QA's: a value belongs to the person a
    few words before it, an object's noun to the colour right before it) can only be learned once
    some heads attend by position, and from a random start the biases take many examples to get
    there (results/README.md#built-in-qa)."""
    for stack, offsets, bidirectional in ((backbone.encoder, encoder, True),
                                          (backbone.decoder, decoder, False)):
        if not offsets:
            continue
        attention = bias_owner(stack)
        table = attention.relative_attention_bias.weight    # (buckets, heads)
        heads = torch.arange(len(offsets))
        buckets = relative_position_buckets(attention, torch.tensor(offsets), bidirectional)
        with torch.no_grad():
            table[:, : len(offsets)] = 0.0
            table[buckets, heads] = POSITION_HEAD_BIAS
