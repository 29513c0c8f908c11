"""Backbones: a small random T5 built from a config (offline) or a pretrained T5, from the hub or
from a local folder (`model.hub_id=DIR`)."""
from __future__ import annotations

from omegaconf import DictConfig
from transformers import T5Config, T5ForConditionalGeneration

from datamodules.tokenizer import pretrained_files
from decoders.transformers_internals import set_attention_implementation


class ModelError(RuntimeError):
    """A backbone could not be built or loaded; the message says what to do instead."""


def build_backbone(model: DictConfig, tokenizer,
                   stored_config: dict | None = None) -> T5ForConditionalGeneration:
    """The backbone `model` describes, for `tokenizer`. `stored_config` is the architecture a
    checkpoint carries (its backbone's T5Config as a dict), for a backbone whose weights come from
    that checkpoint: a pretrained one is then built from it, without its folder or the hub."""
    # `model.attn_implementation` (sdpa by default, as in transformers: fused kernels on GPUs, or
    # eager): the decoders' own attention structures hold under both (decoders.backbone.run_decoder).
    if model.name == "t5-tiny":  # its architecture is the configuration's
        config = T5Config(vocab_size=len(tokenizer), d_model=model.d_model, d_ff=model.d_ff,
                          d_kv=model.d_kv, num_heads=model.num_heads, num_layers=model.num_layers,
                          num_decoder_layers=model.num_decoder_layers, dropout_rate=model.dropout,
                          initializer_factor=float(model.initializer_factor),
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.pad_token_id)
        set_attention_implementation(config, model.attn_implementation)
        return T5ForConditionalGeneration(config)
    if stored_config is not None:  # random weights, replaced by the checkpoint's
        config = T5Config.from_dict(stored_config, dropout_rate=model.dropout)
        set_attention_implementation(config, model.attn_implementation)
        backbone = T5ForConditionalGeneration(config)
    else:
        with pretrained_files(model.hub_id, "pretrained weights", ModelError) as name:
            backbone = T5ForConditionalGeneration.from_pretrained(
                name, attn_implementation=model.attn_implementation, dropout_rate=model.dropout)
    if len(tokenizer) > backbone.get_input_embeddings().num_embeddings:
        backbone.resize_token_embeddings(len(tokenizer))  # room for <sep> and <mask>
    return backbone
