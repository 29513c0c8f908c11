"""Backbones: a small random T5 built from a config (offline) or a pretrained T5 from the hub."""
from __future__ import annotations

from omegaconf import DictConfig
from transformers import T5Config, T5ForConditionalGeneration


class ModelError(RuntimeError):
    """A backbone could not be built or loaded; the message says what to do instead."""


def build_backbone(model: DictConfig, tokenizer) -> T5ForConditionalGeneration:
    # Eager attention: the pipelined decoder adds its own (B, heads, queries, keys) bias + mask to
    # the attention scores, which only the eager implementation takes.
    if model.name == "t5-tiny":
        config = T5Config(vocab_size=len(tokenizer), d_model=model.d_model, d_ff=model.d_ff,
                          d_kv=model.d_kv, num_heads=model.num_heads, num_layers=model.num_layers,
                          num_decoder_layers=model.num_decoder_layers, dropout_rate=model.dropout,
                          initializer_factor=float(model.initializer_factor),
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.pad_token_id)
        config._attn_implementation = "eager"
        return T5ForConditionalGeneration(config)
    from datamodules.hub import hub_access, load_failure  # imports `datasets`: only for hub models
    with hub_access() as unreachable:
        try:
            backbone = T5ForConditionalGeneration.from_pretrained(
                model.hub_id, attn_implementation="eager", dropout_rate=model.dropout)
        except OSError as err:
            raise ModelError(f"cannot load pretrained weights {model.hub_id!r}: "
                             f"{load_failure(err, unreachable)}. Use model=t5-tiny to work "
                             f"offline.") from err
    if len(tokenizer) > backbone.get_input_embeddings().num_embeddings:
        backbone.resize_token_embeddings(len(tokenizer))  # room for <sep> and <mask>
    return backbone
