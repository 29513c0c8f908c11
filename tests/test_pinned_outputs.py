"""Every decoder still outputs what the pinned reference holds (`tests/data/pinned_outputs.json`,
made by `python -m tests.pinned_outputs`): each case is rebuilt and decoded as the file was
made, and every field of its `DecodeOutput` must equal the recorded one, bit for bit.

The reference keeps only cases whose every decision had a wide margin (`tests/pinned_outputs.py`),
so they decode the same at every CPU kernel level: a difference is a change of the decoder's output.
If that change is intended, regenerate the file and review its diff.
"""
import dataclasses
import json

import pytest

from tests.pinned_outputs import PINNED_DECODERS, REFERENCE, case_id, decode_case

pytestmark = [pytest.mark.float64, pytest.mark.numerics]

ENTRIES = json.loads(REFERENCE.read_text())["cases"]
PER_EXAMPLE = ("subsequences", "decoder_calls", "tokens", "bound_hit")


@pytest.mark.parametrize("entry", ENTRIES, ids=[case_id(entry["case"]) for entry in ENTRIES])
def test_decoding_reproduces_the_reference(entry):
    name = case_id(entry["case"])
    output, reference = dataclasses.asdict(decode_case(entry["case"])), entry["output"]
    assert output.keys() == reference.keys(), (
        f"{name}: DecodeOutput's fields {sorted(output)} are not the reference's "
        f"{sorted(reference)}")
    differences = [f"{field}: decoded {output[field]}, reference {reference[field]}"
                   for field in reference if output[field] != reference[field]]
    assert not differences, f"{name} differs from the reference:\n" + "\n".join(differences)


def entries_of(decoder: str) -> list[dict]:
    return [entry for entry in ENTRIES if entry["case"]["decoder"] == decoder]


def examples_of(decoder: str) -> list[dict]:
    """Every example of the decoder's recorded outputs: its per-example fields, and its case."""
    return [{"case": entry["case"], **{field: entry["output"][field][row] for field in PER_EXAMPLE}}
            for entry in entries_of(decoder) for row in range(entry["case"]["batch_size"])]


@pytest.mark.parametrize("decoder", PINNED_DECODERS)
def test_the_reference_pins_varied_outputs_of_every_decoder(decoder):
    cases, examples = len(entries_of(decoder)), examples_of(decoder)
    assert cases >= 8, f"the reference pins {cases} cases of {decoder}"
    cut = [example["bound_hit"] for example in examples]
    assert any(cut), f"no {decoder} output is cut by a bound"
    assert not all(cut), f"no {decoder} output ends by itself"
    lengths = {example["tokens"] for example in examples}
    assert len(lengths) >= 3, f"{decoder}'s outputs have {len(lengths)} lengths"


def test_the_reference_pins_what_only_some_decoders_do():
    blockwise = examples_of("blockwise")
    # rows whose proposals were never accepted, and rows that accepted some but not all of them
    assert any(example["decoder_calls"] == example["tokens"] > 1 for example in blockwise)
    assert any(1 < example["tokens"] / example["decoder_calls"]
               < example["case"]["options"]["block_size"] for example in blockwise)
    # pipelined outputs of several subsequences that ended by themselves
    assert any(len(example["subsequences"]) > 1 and not example["bound_hit"]
               for example in examples_of("pipelined"))
    # nar with several length candidates and several passes
    assert any(entry["case"]["options"]["length_candidates"] > 1
               and entry["output"]["batch_decoder_calls"] > 1 for entry in entries_of("nar"))
