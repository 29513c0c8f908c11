"""The decoders' outputs pinned: `tests/data/pinned_outputs.json` holds what every decoder
outputs on a set of fixed cases, and `tests/test_pinned_outputs.py` decodes the same cases and
requires the same `DecodeOutput`, field for field and bit for bit.

A rewrite of a decoding loop that must not change what it outputs (fewer tensor ops per call, other
bookkeeping) is checked against this file. Regenerating it is a deliberate act, for a change that
is meant to change outputs; the file was made by

    python -m tests.pinned_outputs

A case is a decoder with its options, a tiny random T5 (`tests.conftest.tiny_t5`), the decoder's own
modules drawn from a seed, and a batch of `tests.conftest.random_batch`. Everything is drawn from
torch's seeded CPU random generator and decoded in float64, so a case is the same on every machine.

Across CPUs. PyTorch's CPU kernel levels (`ATEN_CPU_CAPABILITY`: default, avx2, avx512) round
float64 differently in the last bits, and on a random model those bits can decide a near tie
(docs/testing.md). So the generator measures each case's decision margin, the smallest gap between
two values whose order one of the decode's decisions read (`decision_margin`), and keeps only the
cases whose margin exceeds `MIN_MARGIN`, orders of magnitude above any rounding difference: a kept
case decodes the same at every kernel level.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

import torch

import decoders.nar
from decoders import DecodeOutput, build_decoder
from tests.conftest import SEED_SHIFT, SPECIAL, always_feeding, default_dtype, random_batch, tiny_t5

REFERENCE = Path(__file__).parent / "data" / "pinned_outputs.json"
# The smallest decision margin a kept case may have. The tiny T5's logits are of order 1 to 100,
# and what the kernel levels compute of them in float64 differs by about 1e-13.
MIN_MARGIN = 1e-6
# Standard deviation of the weights drawn for a decoder's zero-initialised parameters
# (`build_case`): small enough that blockwise's proposal heads are often right (the random T5 often repeats a
# token), large enough that they are often wrong.
MODULE_SCALE = 0.1
# T5's init scale of the tiny model per decoder: `tiny_t5`'s 6 gives varied outputs; nar's at 6
# would be so sure of its tokens that their log-probabilities round to 0 and tie, and which of them
# it re-masks would be decided by rounding.
INITIALIZER_FACTOR = {"nar": 2.0}
# (model seed, batch size, batch seed) of each variant's cases
MODELS_AND_BATCHES = [(0, 8, 1), (1, 8, 1), (2, 1, 2), (2, 3, 3)]


# ---- the cases ----------------------------------------------------------------------------------

# The decoders whose outputs are pinned. The decoders that only draft for a verifier (lookup,
# aggressive) are exactly sequential greedy decoding, which their own tests check token for token.
PINNED_DECODERS = ("blockwise", "nar", "onestep", "pipelined", "sequential")


def option_variants(decoder: str) -> list[dict]:
    """The options decoder `decoder` is pinned with: its main variants and the bounds that cut
    its outputs."""
    return {
        "sequential": [{"max_new_tokens": 4}, {"max_new_tokens": 40}],
        "blockwise": [{"block_size": block_size, "top_k": top_k, "max_new_tokens": bound}
                      for block_size in (2, 4) for top_k in (1, 2) for bound in (5, 40)],
        # every pipelined case states its output bound, 128 where no other is pinned
        "pipelined": [{**options, "max_new_tokens": options.get("max_new_tokens", 128)} for options in (
            [{"delay": delay, "stop_rule": rule, "max_subsequences": 6, "max_subsequence_length": 8}
             for delay in (1, 2, 3) for rule in ("first_empty", "all_end")]
            + [{"delay": 1}, {"delay": 1, "max_new_tokens": 5}, {"delay": 2, "max_subsequences": 2},
               {"delay": 1, "max_subsequence_length": 3}, {"delay": 2, "max_steps": 4},
               {"delay": 1, "stop_rule": "all_end", "max_subsequences": 2}])],
        "nar": [{"iterations": iterations, "length_candidates": candidates, "max_new_tokens": bound}
                for iterations in (1, 4, 10) for candidates in (1, 3) for bound in (8, 40)],
        "onestep": [{"max_new_tokens": 5}, {"max_new_tokens": 40}],
    }[decoder]


def candidate_cases() -> list[dict]:
    """Every case the generator tries: each decoder's option variants on each model and batch."""
    return [{"decoder": name, "options": options, "model_seed": model_seed,
             "initializer_factor": INITIALIZER_FACTOR.get(name, 6.0), "decoder_seed": 0,
             "module_scale": MODULE_SCALE, "batch_size": batch_size, "batch_seed": batch_seed,
             "max_len": 12}
            for name in PINNED_DECODERS for options in option_variants(name)
            for model_seed, batch_size, batch_seed in MODELS_AND_BATCHES]


def case_id(case: dict) -> str:
    """A readable, unique name of a case (the test's parameter id)."""
    options = ",".join(f"{key}={value}" for key, value in case["options"].items())
    return (f"{case['decoder']}[{options}]-model{case['model_seed']}"
            f"-batch{case['batch_size']}x{case['batch_seed']}")


# ---- building and decoding a case ---------------------------------------------------------------

def build_case(case: dict):
    """A case's (model, decoder, input_ids, attention_mask), built in float64.

    The decoder's modules are drawn from `decoder_seed`; its zero-initialised parameters (the last
    layer of blockwise's proposal heads and of onestep's proto-token encoder) are then drawn too,
    with standard deviation `module_scale`: at zero those modules would add nothing (every proposal
    head would propose the base head's token again) and the decode would not exercise them.
    """
    with default_dtype(torch.float64):
        # The reference pins particular seeds: undo the suite's seed shift (PIPEDEC_TEST_SEED),
        # which varies the draws of the tests that look for their cases by property.
        model = tiny_t5(case["model_seed"] - SEED_SHIFT,
                        initializer_factor=case["initializer_factor"])
        torch.manual_seed(case["decoder_seed"])
        # every call feeds its drafts: the measured rule's calls would follow the machine's timing
        decoder = build_decoder(case["decoder"], model.config, SPECIAL,
                                **{**always_feeding(case["decoder"]), **case["options"]}).eval()
        with torch.no_grad():
            for parameter in decoder.parameters():
                if not parameter.any():
                    parameter.normal_(std=case["module_scale"])
        input_ids, attention_mask = random_batch(case["batch_size"], case["max_len"],
                                                 seed=case["batch_seed"] - SEED_SHIFT)
    return model, decoder, input_ids, attention_mask


def decode_case(case: dict) -> DecodeOutput:
    """The case's decode, in float64."""
    model, decoder, input_ids, attention_mask = build_case(case)
    with default_dtype(torch.float64), torch.no_grad():
        return decoder.generate(model, input_ids, attention_mask)


# ---- decision margins ---------------------------------------------------------------------------

def smallest_gap(values: torch.Tensor, count: int) -> torch.Tensor:
    """(..., n) -> the smallest gap between consecutive values among every row's `count` + 1
    largest: how near the row is to changing its top `count` (which they are, or their order)."""
    top = values.topk(min(count + 1, values.size(-1)), dim=-1).values
    return (top[..., :-1] - top[..., 1:]).min()


def decision_margin(case: dict) -> tuple[DecodeOutput, float]:
    """The case's decode, and its decision margin: the smallest gap, over every decision the decode
    took, between the values the decision compared.

    Every decoder picks tokens from the vocabulary logits (`model.lm_head`'s outputs): an argmax
    (the gap between the best and the second best logit) or, in blockwise's top-k acceptance, a
    top-k set (every gap among the top_k + 1 best). Every row the output head computes counts,
    whether or not the decode used its decision, so the margin is a lower bound. nar compares other
    values too (`NarDecisions`).
    """
    model, decoder, input_ids, attention_mask = build_case(case)
    ranked = getattr(decoder, "top_k", 1)
    never_chosen = [SPECIAL.mask] if case["decoder"] == "nar" else []  # nar never outputs a mask
    logits, gaps = [], []

    def record(module, inputs, output):
        logits.append(output)
        choices = output.clone()
        choices[..., never_chosen] = float("-inf")
        gaps.append(smallest_gap(choices, ranked))

    hook = model.lm_head.register_forward_hook(record)
    with default_dtype(torch.float64), torch.no_grad():
        if case["decoder"] == "nar":
            nar = NarDecisions(decoder)
            with mock.patch.object(decoders.nar, "tokens_to_remask", nar.tokens_to_remask):
                output = decoder.generate(model, input_ids, attention_mask)
            gaps += nar.gaps(logits)
        else:
            output = decoder.generate(model, input_ids, attention_mask)
    hook.remove()
    return output, float(torch.stack(gaps).min())


class NarDecisions:
    """The gaps of Mask-Predict's decisions beyond its argmaxes: which lengths the length predictor
    ranks first, which positions' confidences are lowest (those re-masked), and which length
    candidate has the best mean log-probability."""

    def __init__(self, decoder):
        self.candidates = decoder.length_candidates
        self.remask = decoders.nar.tokens_to_remask
        self.decision_gaps: list[torch.Tensor] = []
        self.remasked: list[torch.Tensor] = []     # (N, W) per pass after the first
        self.lengths: torch.Tensor | None = None   # (N,) every candidate's length
        decoder.length_predictor.register_forward_hook(self.record_lengths)

    def record_lengths(self, module, inputs, scores):
        # the candidates are the `length_candidates` best lengths, in order (a stable sort)
        self.decision_gaps.append(smallest_gap(scores, self.candidates))
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        self.lengths = (order[:, :self.candidates] + 1).reshape(-1)

    def tokens_to_remask(self, confidence, lengths, iteration, iterations, given=None):
        """`decoders.nar.tokens_to_remask`, recording the gap between the last re-masked and the
        first kept confidence of every row's free (not given) positions."""
        remask = self.remask(confidence, lengths, iteration, iterations, given)
        starts = [0] * len(lengths) if given is None else given.tolist()
        for row, (start, length) in enumerate(zip(starts, lengths.tolist())):
            free = length - start
            remasked = free * (iterations - iteration) // iterations
            if 0 < remasked < free:
                ordered = confidence[row, start:length].sort().values
                self.decision_gaps.append(ordered[remasked] - ordered[remasked - 1])
        self.remasked.append(remask)
        return remask

    def gaps(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The recorded gaps and, with several length candidates, each example's gap between its
        best and second best mean log-probability. `logits`: the (N, W, V) logits of every pass."""
        if len(self.remasked) != len(logits) - 1:
            raise RuntimeError(f"nar ran {len(logits)} passes and re-masked before "
                               f"{len(self.remasked)}: its re-masking no longer goes through "
                               f"decoders.nar.tokens_to_remask, where this records its gaps")
        if self.candidates == 1:
            return self.decision_gaps
        # a position's confidence: its token's log-probability, normalised over the whole
        # vocabulary, the mask token never being its token; a pass updates the re-masked positions
        confidence = None
        for remask, pass_logits in zip([None] + self.remasked, logits):
            log_probs = torch.log_softmax(pass_logits, -1)
            log_probs[..., SPECIAL.mask] = float("-inf")
            new = log_probs.max(-1).values
            confidence = new if remask is None else torch.where(remask, new, confidence)
        valid = torch.arange(confidence.size(1))[None, :] < self.lengths[:, None]
        mean = confidence.masked_fill(~valid, 0.0).sum(1) / self.lengths
        return self.decision_gaps + [smallest_gap(mean.view(-1, self.candidates), 1)]


# ---- the reference file -------------------------------------------------------------------------

def main() -> None:
    kept, dropped = [], []
    for case in candidate_cases():
        output, margin = decision_margin(case)
        if margin > MIN_MARGIN:
            kept.append({"case": case, "margin": margin, "output": dataclasses.asdict(output)})
        else:
            dropped.append(f"{case_id(case)}: decision margin {margin:.3g}")
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    # one case per line, so that a change of output shows as the changed cases' lines
    lines = ",\n".join(json.dumps(entry) for entry in kept)
    REFERENCE.write_text(f'{{"min_margin": {MIN_MARGIN},\n"cases": [\n{lines}\n]}}\n')
    for line in dropped:
        print(f"left out {line}")
    print(f"{REFERENCE}: {len(kept)} cases kept, {len(dropped)} left out "
          f"(decision margin <= {MIN_MARGIN})")


if __name__ == "__main__":
    main()
