"""Non-autoregressive decoder: Mask-Predict over a conditional masked language model (CMLM).

Reference: Ghazvininejad, Levy, Liu, Zettlemoyer 2019, "Mask-Predict: Parallel Decoding of
Conditional Masked Language Models" (EMNLP 2019). One iteration (T=1) is one-pass generation.

Layout: as sequential, target = s_1 <sep> s_2 ... s_m </s> (`join_subsequences`), of length L
        (end token included); position i of the decoder predicts target token i (no shift).
Model:  T5's decoder with *bidirectional* self-attention (every position sees every target
        position) and a learned absolute position embedding added to its input (see below), plus a
        length predictor: a linear classifier over lengths 1..max_new_tokens on the masked mean of
        the encoder output. Both are submodules of this decoder (trained and checkpointed with it).
Loss:   per example draw n ~ U{1..L}, replace n uniformly chosen target positions by the mask token,
        cross-entropy of the masked positions' tokens + length_loss_weight * cross-entropy of L.
        With `freeze_encoder` the encoder and the token embeddings keep their starting weights, so a
        drafter started from a verifier's checkpoint can read that verifier's encoder states.
Decode: predict the top-`length_candidates` lengths; for each, start from L mask tokens and predict
        every position in one pass; then for t = 1..T-1 re-mask the n = floor(L*(T-t)/T) least
        confident tokens (ties: lower position first) and predict them again, updating tokens and
        confidences only at the re-masked positions. Keep the candidate with the highest mean
        log-probability; output its tokens up to the first end token, split on the separator.
        A token's confidence is its log-probability under the softmax over the whole vocabulary
        (the mask token included, though it is never predicted), taken block by block of positions
        so that no second (B*k, W, V) tensor exists beside the logits.

Counting: floor(L*(T-t)/T) shrinks as t grows, and an iteration that re-masks nothing would change
nothing, so a candidate of length L needs `mask_predict_passes(L, T)` = T + 1 - ceil(T/L) passes
(T whenever L >= T; one pass for L = 1). All candidates of all examples go through ONE batched
decoder call per pass, and the batch runs as many passes as its longest candidate needs
(`batch_decoder_calls`). An example's `decoder_calls` are the passes in which one of its own
candidates had something re-masked, i.e. those its longest candidate needs: a function of the
example alone, the same decoded alone or in any batch. Longer rows of a batch can make it run more
passes than an example needs; in those its rows ride along unchanged. `calls_for_output` counts
them from the length L of an output as a model that reproduces it writes it (its flat target,
end token last): exact with one candidate; with several, the other candidates' lengths are the
model's, so it is known only when max(L, candidates) >= T (k distinct lengths, the longest is
>= k) and None otherwise.
`tokens` is the chosen candidate's length L (every position is produced, the end token included).
`bound_hit` is True when the predicted length is the bound `max_new_tokens` and no end token
came, i.e. the output may have been cut by the bound.

Position bias: T5's decoder owns a relative-position table made for unidirectional (past-only)
buckets. Here keys also lie in the future, so the bucket is T5's bidirectional bucketing of
key_pos - query_pos (`backbone.relative_position_bias(..., bidirectional=True)`) looked up in the first
decoder layer's `relative_attention_bias`, as T5's encoder does with its own table. With 32 buckets
the past distances then use buckets 0..15 (coarser) and future distances 16..31, rows that a
pretrained T5 decoder learned for long past distances: fine-tuning re-learns them. This keeps the
parameter set of the backbone unchanged (no new table), so a checkpoint stays a plain T5.

Absolute positions: T5 has none; position enters only through the relative bias, i.e. through the
attention *weights*. In decoding's first pass every input is the mask token, so every value vector
is the same and any weighting of them gives the same result: without absolute positions all
positions get the same hidden state and one-pass generation repeats one token L times (re-masking
could only break the symmetry through float noise). CMLM (a standard Transformer) has absolute
position embeddings; here a learned table (max_new_tokens, d_model) is added to the decoder's input
embeddings. That is why this decoder adds a learned absolute position table to its inputs
(`run_decoder(..., position_embeddings=...)`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from decoders import register
from datamodules.vocabulary import pad_batch, Range, SpecialTokens
from decoders.backbone import (at_least_float32, cross_attention_mask, encode, encoder_weights,
                               hidden_mask, made_from_bias_weight, masked_mean, output_logits,
                               relative_position_bias, sizes, with_frozen_weights)
from decoders.base import OUTPUT_BOUND, Decoder, Option
from decoders.loop import flat_decode_output
from decoders.sequential import join_subsequences


# ---- pure helpers (tested on their own) ---------------------------------------------------------

def bidirectional_position_bias(model, width: int, device: torch.device) -> torch.Tensor:
    """T5 relative-position bias for a fully visible target of `width` positions.

    -> (1, heads, width, width). Bucket of (query q, key k) = T5's bidirectional bucketing of k - q,
    through the first decoder layer's bias table (only layer 0 owns one; see the module docstring).
    """
    def table() -> torch.Tensor:
        positions = torch.arange(width, device=device)
        # base's distance is how far the key lies in the past, q - k; it buckets -distance = k - q
        distance = positions[:, None] - positions[None, :]        # (queries, keys): query - key
        return relative_position_bias(model, distance[None], bidirectional=True)
    # decoding makes it once per weights and width (`made_from_bias_weight`), not once per pass
    return made_from_bias_weight(model, ("bidirectional", width, device), table)


def self_attention_bias(model, valid: torch.Tensor) -> torch.Tensor:
    """Bidirectional self-attention bias of a right-padded target.

    valid: (B, W) bool, True at real target positions -> (B, heads, W, W): relative bias + a large
    negative value at padding keys. Padding *queries* still see the real keys; their outputs are
    never used, and this keeps every softmax row non-empty.
    """
    width = valid.size(1)
    relative = bidirectional_position_bias(model, width, valid.device)    # (1, heads, W, W)
    keys_visible = valid[:, None, :].expand(-1, width, -1)                # (B, W queries, W keys)
    return relative + hidden_mask(keys_visible, relative.dtype)           # (B, heads, W, W)


def tokens_to_remask(confidence: torch.Tensor, lengths: torch.Tensor, iteration: int,
                     iterations: int, given: torch.Tensor | None = None) -> torch.Tensor:
    """Mask-Predict's schedule: which positions to re-mask before iteration `iteration` (0-based).

    confidence: (B, W) score of each current token (a probability or a log-probability: only the
    order matters); lengths: (B,) real lengths L, positions >= L are padding; given: (B,) how many
    leading positions are given (fixed tokens, never re-masked; None: none are).
    Re-masks the n = floor(F * (T - t) / T) least confident of the F = L - given free positions of
    each row (t = 0: all of them); ties are broken towards the lower position.
    -> (B, W) bool.
    """
    if not 0 <= iteration < iterations:
        raise ValueError(f"iteration must be in 0..{iterations - 1}, got {iteration}")
    width = confidence.size(1)
    positions = torch.arange(width, device=confidence.device)[None, :]
    free = positions < lengths[:, None]                                                   # (B, W)
    free_count = lengths
    if given is not None:
        free = free & (positions >= given[:, None])
        free_count = lengths - given
    count = torch.div(free_count * (iterations - iteration), iterations, rounding_mode="floor")  # (B,)
    # +inf puts padding and given positions after every free one; a stable ascending sort keeps
    # the lower position first among equal confidences, which makes the choice deterministic.
    order = torch.sort(confidence.masked_fill(~free, float("inf")), dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(width, device=order.device).expand_as(order))              # (B, W)
    return (rank < count[:, None]) & free


def mask_predict_passes(length: int, iterations: int) -> int:
    """Decoder passes Mask-Predict needs for a target of `length` L >= 1 with T = `iterations` (or
    for L free positions of a longer target whose other positions are given).

    Pass 0 predicts all L positions; iteration t = 1..T-1 re-masks floor(L*(T-t)/T) of them, which
    is > 0 iff T - t >= T/L, i.e. t <= T - ceil(T/L) (the count only shrinks with t). Iterations
    that re-mask nothing change nothing and are skipped: 1 + T - ceil(T/L) passes, T if L >= T.
    """
    return iterations + 1 - -(-iterations // length)


def sample_training_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """CMLM training mask: per row n ~ U{1..L}, then n of the L real positions uniformly at random.

    Uses the global torch RNG (seeded by Lightning), so training is reproducible with the seed.
    lengths: (B,) -> (B, width) bool.
    """
    device = lengths.device
    batch = lengths.size(0)
    count = (torch.rand(batch, device=device) * lengths).long().clamp(max=lengths - 1) + 1  # (B,)
    valid = torch.arange(width, device=device)[None, :] < lengths[:, None]                  # (B, W)
    # random keys, padding last: the n smallest keys of a row are a uniform n-subset of its positions
    keys = torch.rand(batch, width, device=device).masked_fill(~valid, 2.0)
    rank = keys.argsort(dim=1).argsort(dim=1)                                                # (B, W)
    return rank < count[:, None]


# How many log-probabilities decoding computes at a time, whole positions per block (32 MiB in
# float32): a twelfth of the (N, W, V) logits at N=32, W=96 and T5's 32k vocabulary, one block for
# small batches. Smaller blocks save little more and cost more kernel launches per pass on a GPU.
LOG_SOFTMAX_BLOCK = 2 ** 23


class PredictedOutputs(NamedTuple):
    """`MaskPredictDecoder.predict_outputs`: every example's chosen candidate."""

    tokens: torch.Tensor              # (B, W) its tokens, padding after its length
    lengths: torch.Tensor             # (B,) its length L, on the device
    passes: list[int]                 # host: the decoder passes the example's candidates needed
    host_lengths: list[int] | None    # host: `lengths`, where the one read-back before decoding
                                      # already holds them (one candidate each); None: not read


# ---- the decoder ----------------------------------------------------------------------------------

@register("nar")
class MaskPredictDecoder(Decoder):
    # iterations and length_candidates only change generation: a trained model decodes with any
    # value (tasks.compare sweeps them untrained); max_new_tokens sets the shapes of the trained
    # modules and length_loss_weight the training
    options = {"max_new_tokens": replace(OUTPUT_BOUND, decode_only=False),
               "iterations": Option(4, Range(ge=1), decode_only=True),
               "length_candidates": Option(1, Range(ge=1, le="max_new_tokens"), decode_only=True),
               "length_loss_weight": Option(0.1, Range(ge=0, integer=False)),
               "freeze_encoder": Option(False)}

    def __init__(self, backbone_config, special: SpecialTokens, **options):
        super().__init__(backbone_config, special, **options)
        # class k <-> length k + 1; a submodule, so it is trained, checkpointed and moved with the task
        size = sizes(backbone_config)
        self.length_predictor = nn.Linear(size.d_model, self.max_new_tokens)
        # absolute positions 0..max_new_tokens-1 (see the module docstring); initialised at the
        # scale of the backbone's own token embeddings so that positions are told apart from the
        # first step on
        self.position_embedding = nn.Embedding(self.max_new_tokens, size.d_model)
        nn.init.normal_(self.position_embedding.weight, std=size.init_std)

    # -- the decoder stack -----------------------------------------------------------------------
    def decoder_hidden(self, model, decoder_input: torch.Tensor, self_bias: torch.Tensor,
                       encoder_states: torch.Tensor, encoder_mask: torch.Tensor) -> torch.Tensor:
        """One decoder pass: T5's blocks on token + absolute position embeddings.

        decoder_input: (B, W) ids, W <= max_new_tokens; self_bias: (B, heads, W, W) (bias + visibility);
        encoder_states: (B, S, d_model); encoder_mask: (B, S) 1/0, or its `cross_attention_mask`
        -> final hidden states (B, W, d_model). As `backbone.run_decoder`, without a cache: every pass
        recomputes all positions, since their inputs change.
        """
        width = decoder_input.size(1)
        positions = torch.arange(width, device=decoder_input.device)[None]              # (1, W)
        return self.model_step()(model, decoder_input, self_bias, encoder_states, encoder_mask,
                                 positions=positions,
                                 position_embeddings=self.position_embedding.weight[None, :width])

    # -- length prediction ---------------------------------------------------------------------
    def length_logits(self, encoder_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, d_model) encoder output, (B, S) 1/0 mask -> (B, max_new_tokens) logits over
        lengths 1..max_new_tokens.

        Pooling is a masked mean so that padding added by batching does not change an example's
        prediction.
        """
        pooled = masked_mean(encoder_states, attention_mask)                        # (B, d_model)
        return self.length_predictor(pooled)

    # -- layout and loss -----------------------------------------------------------------------
    def layout(self, targets):
        # A target longer than max_new_tokens (the datamodule keeps targets within
        # data.max_target_length, max_new_tokens's default) is cut to it: no decode can be longer.
        flat = [join_subsequences(subs, self.special.sep, self.special.eos)[: self.max_new_tokens]
                for subs in targets]
        return {
            "target": pad_batch(flat, self.special.pad),                     # (B, W)
            "lengths": torch.tensor([len(f) for f in flat], dtype=torch.long),  # (B,) L, end included
        }

    def calls_for_output(self, subsequences):
        # L as decoding produces it: the flat target up to its end token, cut to max_new_tokens
        length = min(len(join_subsequences(subsequences, self.special.sep, self.special.eos)),
                     self.max_new_tokens)
        # The other candidates' lengths are the model's, k distinct lengths, so the longest is >= k:
        # the count is known when max(L, k) already needs every iteration (or when k = 1).
        calls = mask_predict_passes(max(length, self.length_candidates), self.iterations)
        if self.length_candidates > 1 and calls < self.iterations:
            return None
        return calls

    def loss(self, model, input_ids, attention_mask, layout):
        if not self.freeze_encoder:
            encoder_states = encode(model, input_ids, attention_mask)       # (B, S, d_model)
            return self.loss_given_encoding(model, encoder_states, attention_mask, layout)
        # The encoder keeps the weights it starts from (`train.init_from`'s), token embeddings
        # included: those are the decoder's input and output projection too, so they are frozen
        # there as well. A verifier with that encoder then serves its states to this model as a
        # drafter (`AggressiveDecoder.attach_drafter`).
        with torch.no_grad():
            encoder_states = encode(model, input_ids, attention_mask)
        return with_frozen_weights(model, self.loss_given_encoding, encoder_states, attention_mask,
                                   layout, only=encoder_weights(model))

    def loss_given_encoding(self, model, encoder_states, attention_mask, layout):
        """The loss (module docstring, "Loss") of a batch whose encoder states are given."""
        target, lengths = layout["target"], layout["lengths"]                # (B, W), (B,)
        width = target.size(1)

        masked = sample_training_mask(lengths, width)                        # (B, W) bool
        decoder_input = target.masked_fill(masked, self.special.mask)
        valid = torch.arange(width, device=target.device)[None, :] < lengths[:, None]
        hidden = self.decoder_hidden(model, decoder_input, self_attention_bias(model, valid),
                                     encoder_states, attention_mask)        # (B, W, d_model)
        # the vocabulary projection only where there is a label: the masked positions (M of them)
        token_loss = F.cross_entropy(output_logits(model, hidden[masked]), target[masked])  # (M, V)

        length_target = lengths - 1                                         # (B,) class index
        length_loss = F.cross_entropy(self.length_logits(encoder_states, attention_mask), length_target)
        return token_loss + self.length_loss_weight * length_loss

    # -- generation ----------------------------------------------------------------------------
    def _predict(self, model, decoder_input, bias, encoder_states, encoder_mask, confidences=True):
        """One decoder call -> (tokens, confidences), both (N, W): the most likely token other than
        the mask token, and its log-probability under the softmax over the WHOLE vocabulary (None
        where `confidences` is False: nobody reads them, and the argmax of the logits is the token).

        The log-softmax runs block by block of positions (at most LOG_SOFTMAX_BLOCK values) into
        one reused buffer: it is computed row by row, so the values are bit for bit those of one
        log-softmax over all (N, W, V) logits, without a second tensor of that size beside them.
        """
        hidden = self.decoder_hidden(model, decoder_input, bias, encoder_states, encoder_mask)
        logits = at_least_float32(output_logits(model, hidden))                        # (N, W, V)
        if not confidences:
            logits[..., self.special.mask] = float("-inf")   # never a label (below)
            return logits.argmax(-1), None
        flat = logits.flatten(0, 1)                                                    # (N*W, V)
        positions, vocabulary = flat.shape
        rows = min(positions, max(1, LOG_SOFTMAX_BLOCK // vocabulary))
        log_probs = flat.new_empty(rows, vocabulary)                  # the buffer of every block
        confidence = flat.new_empty(positions)                                          # (N*W,)
        tokens = torch.empty(positions, dtype=torch.long, device=flat.device)          # (N*W,)
        for start in range(0, positions, rows):
            end = min(start + rows, positions)
            block = torch.log_softmax(flat[start:end], -1, out=log_probs[: end - start])
            # The mask token is never a label, so predicting it means nothing (and it would be
            # stripped from the text anyway): excluded from the argmax, not from the normaliser.
            block[:, self.special.mask] = float("-inf")
            torch.max(block, -1, out=(confidence[start:end], tokens[start:end]))
        return tokens.view(logits.shape[:2]), confidence.view(logits.shape[:2])

    def mask_predict(self, model, decoder_input: torch.Tensor, lengths: torch.Tensor,
                     given: torch.Tensor | None, passes: int, encoder_states: torch.Tensor,
                     encoder_mask: torch.Tensor,
                     confidences: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mask-Predict of rows of lengths L, in `passes` decoder calls (host int: what the row with
        the most free positions needs, `mask_predict_passes`), the first `given` positions of each
        row fixed (None: none are; a drafter re-drafting after a verified prefix gives them).

        decoder_input: (N, W) the given tokens before `given`, the mask token at the free positions
        given..L-1 and padding after; lengths, given: (N,); encoder_states: (N, S, d_model);
        encoder_mask: its (N, 1, 1, S) `cross_attention_mask`. -> tokens (N, W) (given tokens kept,
        padding after L) and confidences (N, W), meaningful at the free positions (None where
        `confidences` is False and one pass is all: only later iterations read them).
        """
        width = decoder_input.size(1)
        positions = torch.arange(width, device=decoder_input.device)[None, :]
        valid = positions < lengths[:, None]                                   # (N, W)
        free = valid if given is None else valid & (positions >= given[:, None])
        bias = self_attention_bias(model, valid)  # (N, heads, W, W): the same for every iteration

        # iteration 0: every free position predicted in one pass
        tokens, confidence = self._predict(model, decoder_input, bias, encoder_states, encoder_mask,
                                           confidences or passes > 1)
        tokens = torch.where(free, tokens, decoder_input)  # given tokens and padding stay as given
        for t in range(1, passes):  # the later iterations would re-mask nothing
            remask = tokens_to_remask(confidence, lengths, t, self.iterations, given)     # (N, W)
            decoder_input = torch.where(remask, self.special.mask, tokens)                # (N, W)
            new_tokens, new_confidence = self._predict(model, decoder_input, bias, encoder_states,
                                                       encoder_mask)
            # as in Mask-Predict, only the re-masked positions change (token and confidence)
            tokens = torch.where(remask, new_tokens, tokens)
            confidence = torch.where(remask, new_confidence, confidence)
        return tokens, confidence

    def predict_outputs(self, model, encoder_states: torch.Tensor, attention_mask: torch.Tensor,
                        cross_mask: torch.Tensor | None = None):
        """Every example's output, from the encoder's states (B, S, d_model) and mask (B, S) (and
        its (B, 1, 1, S) `cross_attention_mask`, where the caller has it): `PredictedOutputs`, the
        chosen candidate's tokens and length on the device, the passes each example's candidates
        need (see the module docstring), and with one candidate each its length on the host too."""
        batch_size, device = encoder_states.size(0), encoder_states.device
        k = self.length_candidates
        length_scores = self.length_logits(encoder_states, attention_mask)  # (B, max_new_tokens)
        if cross_mask is None:
            cross_mask = cross_attention_mask(attention_mask, encoder_states.dtype)  # once
        if k == 1:   # one candidate each: the most likely length (the shorter one on equal scores)
            lengths = length_scores.argmax(1) + 1                              # (B,)
        else:
            # top-k lengths; a stable descending sort makes equal scores prefer the shorter length
            order = torch.sort(length_scores, dim=1, descending=True, stable=True).indices
            # (N = B*k,): the k candidates of example 0, then those of example 1, ...
            lengths = (order[:, :k] + 1).reshape(-1)
            encoder_states = encoder_states.repeat_interleave(k, dim=0)     # (N, S, d_model)
            cross_mask = cross_mask.repeat_interleave(k, dim=0)             # (N, 1, 1, S)

        # The one read-back before decoding: the width and every pass's re-mask counts follow from
        # the lengths alone, so the loop below needs no other.
        candidate_lengths = lengths.tolist()                                # (N,) on the host
        width = max(candidate_lengths)
        calls = [mask_predict_passes(max(candidate_lengths[i * k:(i + 1) * k]), self.iterations)
                 for i in range(batch_size)]                                # (B,) see the docstring
        valid = torch.arange(width, device=device)[None, :] < lengths[:, None]    # (N, W)
        mask_input = torch.where(valid, self.special.mask, self.special.pad)     # (N, W)
        tokens, confidence = self.mask_predict(model, mask_input, lengths, None, max(calls),
                                               encoder_states, cross_mask, confidences=k > 1)
        if k == 1:
            return PredictedOutputs(tokens, lengths, calls, candidate_lengths)
        # the candidate with the highest mean log-probability (first, i.e. most likely length, on ties)
        mean_log_prob = (confidence.masked_fill(~valid, 0.0).sum(1) / lengths).view(batch_size, k)
        best = mean_log_prob.argmax(1) + torch.arange(batch_size, device=device) * k      # (B,) row in N
        return PredictedOutputs(tokens[best], lengths[best], calls, None)

    @torch.no_grad()
    def generate(self, model, input_ids, attention_mask):
        encoder_states = self.encoder_pass()(model, input_ids, attention_mask)   # (B, S, d_model)
        tokens, lengths, calls, _ = self.predict_outputs(model, encoder_states, attention_mask)
        chosen = torch.cat([lengths[:, None], tokens], dim=1).tolist()    # the results' one read-back

        outputs = [chosen_tokens[:length] for length, *chosen_tokens in chosen]
        # cut by the bound: a predicted length at the bound with no end token in it
        hit_bound = [len(tokens) == self.max_new_tokens and self.special.eos not in tokens
                     for tokens in outputs]
        return flat_decode_output(outputs, self.special, calls, max(calls), bound_hit=hit_bound)
