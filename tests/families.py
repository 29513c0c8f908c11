"""Tiny random models of every type the decoders run beside T5 and mT5 (BART, mBART, Pegasus,
Marian; LongT5 and UMT5, which `conftest.tiny_t5`'s T5 does not cover), whose greedy outputs vary and end at
different steps, with their special tokens and tokenizers."""
from __future__ import annotations

import torch
from transformers import (BartConfig, BartForConditionalGeneration, LongT5Config,
                          LongT5ForConditionalGeneration, MarianConfig, MarianMTModel, MBartConfig,
                          MBartForConditionalGeneration, PegasusConfig, PegasusForConditionalGeneration,
                          UMT5Config, UMT5ForConditionalGeneration)

from datamodules.vocabulary import SpecialTokens
from decoders.transformers_internals import set_attention_implementation

VOCAB = 64
# model type -> (configuration, model class, special ids (pad, eos, start) as each family has them)
FAMILIES = {
    "bart": (BartConfig, BartForConditionalGeneration, (1, 2, 2)),
    "mbart": (MBartConfig, MBartForConditionalGeneration, (1, 2, 2)),
    "pegasus": (PegasusConfig, PegasusForConditionalGeneration, (0, 1, 0)),
    "marian": (MarianConfig, MarianMTModel, (VOCAB - 1, 0, VOCAB - 1)),   # pad: the last id
    "longt5": (LongT5Config, LongT5ForConditionalGeneration, (0, 1, 0)),
    "umt5": (UMT5Config, UMT5ForConditionalGeneration, (0, 1, 0)),
}
FAMILY_TYPES = tuple(FAMILIES)
BART_LIKE = ("bart", "mbart", "pegasus", "marian")   # absolute positions, and built here as <type>-tiny
# above every special id of every family, below Marian's pad
FIRST_ORDINARY, LAST_ORDINARY = 5, VOCAB - 2


def family_special(model_type: str) -> SpecialTokens:
    pad, eos, start = FAMILIES[model_type][2]
    return SpecialTokens(pad=pad, eos=eos, unk=3, sep=3, mask=4, start=start)


def tiny_family_model(model_type: str, seed: int = 1, implementation: str = "eager",
                      **overrides):
    """A tiny random model of `model_type`, in eval mode. As `conftest.tiny_t5`: a wide init
    varies its tokens, and the end token's output row pointed at its favourite token ends rows
    after a few, differing steps."""
    config_class, model_class, (pad, eos, start) = FAMILIES[model_type]
    torch.manual_seed(seed)
    if model_type in ("longt5", "umt5"):   # T5's names of the sizes and of the init's spread
        config = config_class(vocab_size=VOCAB, d_model=64, d_ff=64, d_kv=16, num_heads=4,
                              num_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                              initializer_factor=4.0, pad_token_id=pad, eos_token_id=eos,
                              decoder_start_token_id=start, **overrides)
    else:
        config = config_class(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4,
                              encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                              init_std=2.0, pad_token_id=pad, eos_token_id=eos,
                              bos_token_id=None if model_type == "marian" else 0,
                              decoder_start_token_id=start, forced_eos_token_id=eos, **overrides)
    set_attention_implementation(config, implementation)
    model = model_class(config).eval()
    input_ids, attention_mask = family_batch(model_type, 6, seed=seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=15, forced_eos_token_id=None)
        favourite = torch.mode(out[:, 1:].flatten()).values
        model.lm_head.weight[eos] = model.lm_head.weight[favourite] * 1.02
    return model


def family_batch(model_type: str, batch_size: int = 4, max_len: int = 12, seed: int = 1):
    """Encoder inputs of different lengths, right-padded with the family's pad id, each ending in
    its end token as the family's tokenizers write them."""
    pad, eos, _ = FAMILIES[model_type][2]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, max_len + 1, (batch_size,), generator=g)
    input_ids = torch.full((batch_size, int(lengths.max())), pad, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        input_ids[i, : n - 1] = torch.randint(FIRST_ORDINARY, LAST_ORDINARY + 1, (n - 1,), generator=g)
        input_ids[i, n - 1] = eos
    return input_ids, (input_ids != pad).long()


# model type -> (the names of its special tokens by id, its source template): the families' own
# layouts, on a word-level vocabulary of VOCAB ids
TOKENIZER_LAYOUTS = {
    "bart": ({0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>", 4: "<mask>"}, "<s> $A </s>"),
    "mbart": ({0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>", 4: "<mask>", VOCAB - 2: "en_XX"},
              "$A </s> en_XX"),
    "pegasus": ({0: "<pad>", 1: "</s>", 2: "<mask>", 3: "<unk>", 4: "<mask_1>"}, "$A </s>"),
    "marian": ({0: "</s>", 1: "<unk>", VOCAB - 1: "<pad>"}, "$A </s>"),
    "longt5": ({0: "<pad>", 1: "</s>", 2: "<unk>"}, "$A </s>"),
    "umt5": ({0: "<pad>", 1: "</s>", 2: "<unk>"}, "$A </s>"),
}


def family_tokenizer(model_type: str):
    """A word-level tokenizer in `model_type`'s layout: its special tokens at the family's ids and
    its source template; every other id is the word "w<id>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names, template = TOKENIZER_LAYOUTS[model_type]
    vocab = {names.get(i, f"w{i}"): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [(token, vocab[token]) for token in template.split() if token != "$A"]
    tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    by_name = {name: i for i, name in names.items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        **({"bos_token": "<s>"} if "<s>" in by_name else {}),
        **({"mask_token": "<mask>"} if "<mask>" in by_name else {}),
        additional_special_tokens=[name for name in names.values()
                                   if name not in ("<s>", "</s>", "<pad>", "<unk>", "<mask>")])
