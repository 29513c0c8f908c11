"""ATen ops per decoder call (`tasks.bench.op_counts`): the counter attributes each op to the model
or to the loop around it, on modules built to make a known number of ops; the command counts every
decoder and transformers' generate."""
import json

import pytest
import torch
from torch import nn

from decoders import available
from tasks.bench import GENERATE, op_counts


class AddOnes(nn.Module):
    """A forward of exactly `k` ATen ops."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        for _ in range(self.k):
            x = x + 1
        return x


class Doubled(nn.Module):
    """One op of its own around an `AddOnes(k)`: k + 1 ops."""

    def __init__(self, k: int):
        super().__init__()
        self.inner = AddOnes(k)

    def forward(self, x):
        return self.inner(x * 2)


def test_ops_inside_a_hooked_module_are_the_models_and_nested_ones_count_once():
    outer = Doubled(3)
    x = torch.zeros(4)
    with op_counts.counting_ops([outer, outer.inner]) as counter:
        x = x - 1                # loop: 1
        x = outer(x)             # model: 1 + 3, the inner module's counted once
        x = outer.inner(x)       # model: 3, called on its own
        x = x.neg().abs()        # loop: 2
    assert (counter.model, counter.loop) == (7, 3)


def test_only_the_hooked_modules_count_as_the_model_and_hooks_are_removed():
    outer, x = Doubled(2), torch.zeros(3)
    with op_counts.counting_ops([outer.inner]) as counter:
        outer(x)    # its own op is the loop's, the inner module's two the model's
    assert (counter.model, counter.loop) == (2, 1)
    assert not outer.inner._forward_pre_hooks and not outer.inner._forward_hooks


class Drafting:
    """A stand-in drafter: one method of 2 ops, and a model of its own."""

    def __init__(self):
        self.model = AddOnes(4)

    def draft(self, x):
        return self.model(x.neg()).abs()


def test_a_drafters_methods_and_modules_count_as_the_drafters_and_are_restored():
    drafter, verifier, x = Drafting(), AddOnes(3), torch.zeros(2)
    method = drafter.draft
    with op_counts.counting_ops([verifier], ([drafter.model], [(drafter, "draft")])) as counter:
        x = verifier(x)                  # model: 3
        x = drafter.draft(x)             # drafter: 2 + 4
        x = drafter.model(x) * 2         # drafter: 4 (its module), loop: 1
    assert (counter.model, counter.drafter, counter.loop) == (3, 10, 1)
    assert drafter.draft == method and "draft" not in vars(drafter)
    assert not drafter.model._forward_pre_hooks


class Stepping:
    """A decoder whose model step (the function that runs the decoder layers) is not a module."""

    def model_step(self):
        return lambda x: x.neg().abs()


def test_a_decoders_model_step_counts_as_the_models_and_is_restored():
    decoder, x = Stepping(), torch.zeros(2)
    with op_counts.counting_ops([], decoder=decoder) as counter:
        x = decoder.model_step()(x)      # model: 2
        x = x * 2                        # loop: 1
    assert (counter.model, counter.drafter, counter.loop) == (2, 0, 1)
    assert "model_step" not in vars(decoder)


@pytest.mark.numerics  # decodes a random model: see docs/testing.md
def test_command_counts_every_decoder(tmp_path, capsys):
    out = tmp_path / "ops.json"
    result = op_counts.main(["--batch-sizes", "1,3", "--steps", "8", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps({"steps": 8, "batch_sizes": result}))
    assert "ATen ops per decoder call" in capsys.readouterr().out
    for batch_size, rows in result.items():
        assert set(rows) == {GENERATE, *available()}
        for name, row in rows.items():
            assert row["decoder_calls"] >= 1 and row["model_ops"] > 0 and row["loop_ops"] > 0, name
            # only a decoder drafting with a model of its own runs drafter ops
            assert (row["drafter_ops"] > 0) == (name == "aggressive"), name
        # one token per call with a bias gathered from a table, against the bookkeeping of
        # several subsequences per call
        assert rows["sequential"]["loop_per_call"] < rows["pipelined"]["loop_per_call"], batch_size


@pytest.mark.slow   # every decoder at the command's own settings: most of a minute
def test_the_parallel_decoders_loops_stay_within_their_op_bounds(tmp_path):
    """At the settings results/op_counts.md is made with (batch sizes 1 and 8, every bound 32),
    the loops of pipelined and of the draft-and-verify decoders blockwise and lookup run at most 40
    ops per decoder call, and those of nar and aggressive (its drafter's own work apart) at most 60
    (docs/performance.md): a loop that grows past them fails here, not only in the table."""
    result = op_counts.main(["--out", str(tmp_path / "ops.json")])
    assert {str(batch_size) for batch_size in result} == {"1", "8"}
    for batch_size, rows in result.items():
        for name, bound in (("pipelined", 40), ("blockwise", 40), ("lookup", 40), ("nar", 60),
                            ("aggressive", 60)):
            assert rows[name]["loop_per_call"] <= bound, (name, batch_size, rows[name]["loop_per_call"])
