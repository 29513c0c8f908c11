"""Aggressive decoding: with exact acceptance the tokens are the verifier's sequential greedy tokens,
whatever the drafter drafts (a random Mask-Predict model, or a scripted drafter whose drafts are the
verifier's greedy output corrupted, cut short or run past its end token), alone and in batches whose
rows accept different numbers of tokens; the telemetry adds up; relaxed acceptance (top_k > 1) can
leave greedy decoding where exact acceptance cannot; the given-prefix Mask-Predict keeps its prefix."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from decoders import build_decoder
from decoders.aggressive import MISMATCH, NEVER, OUTGROWN, REALIGN
from decoders.backbone import decoder_inputs, encode, output_logits
from decoders.drafts import Source
from decoders.nar import MaskPredictDecoder, PredictedOutputs, tokens_to_remask
from tests.conftest import (ALWAYS_FEED, SPECIAL, VOCAB, assert_drafts_counted, assert_same_output, greedy_outputs,
                            random_batch, sequential, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py

BOUND = 20
JUNK = 7  # a filler token for scripted drafts past the verifier's output


def aggressive(model, drafter, drafter_model, **options):
    decoder = build_decoder("aggressive", model.config, SPECIAL, max_new_tokens=BOUND,
                            **{**ALWAYS_FEED, **options})
    decoder.attach_drafter(drafter, drafter_model)
    return decoder


def assert_consistent_telemetry(out, draft_tokens):
    """The counters of every drafter (`assert_drafts_counted`; the calls are the verifier's), and
    the drafter's own."""
    assert_drafts_counted(out, draft_tokens, first_call_drafts=True)
    # every call yields its accepted draft tokens and one of its own (the last call may stop at an
    # accepted end token): at most one accepted draft token per example is not output
    stats = out.stats
    assert stats["draft_tokens_accepted"] <= sum(out.tokens) - sum(out.decoder_calls) + len(out.tokens)
    assert stats["drafter_passes"] >= 1 and stats["redrafts"] >= 0


# ---- a scripted drafter --------------------------------------------------------------------------

class SourceEcho(nn.Module):
    """A stand-in for the drafter's T5 whose encoder output is its input ids, so that a scripted
    drafter can tell which example a row is from the encoder states it is given."""

    def get_encoder(self):
        return lambda input_ids, attention_mask: SimpleNamespace(
            last_hidden_state=input_ids[..., None].to(torch.get_default_dtype()))


def source_of(encoder_states: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(t) for t in encoder_states[:, 0].tolist() if t)


class ScriptedDrafter(MaskPredictDecoder):
    """A Mask-Predict drafter whose drafts are scripted per source: the first draft is `first`,
    every re-draft fills the free positions from `later` (JUNK past its end). Counts its passes."""

    def __init__(self, first: dict, later: dict, iterations: int = 3, max_new_tokens: int = BOUND + 4):
        super().__init__(tiny_t5(0).config, SPECIAL, iterations=iterations, max_new_tokens=max_new_tokens)
        self.first, self.later = first, later
        self.redraft_prefixes = []  # (source, given tokens) of every re-drafted row

    def predict_outputs(self, model, encoder_states, attention_mask, cross_mask=None):
        drafts = [self.first[source_of(states)] for states in encoder_states]
        width = max(len(draft) for draft in drafts)
        tokens = torch.tensor([draft + [SPECIAL.pad] * (width - len(draft)) for draft in drafts])
        lengths = [len(draft) for draft in drafts]
        return PredictedOutputs(tokens, torch.tensor(lengths), [self.iterations] * len(drafts), lengths)

    def mask_predict(self, model, decoder_input, lengths, given, passes, encoder_states, encoder_mask,
                     confidences=True):
        tokens = decoder_input.clone()
        for row, states in enumerate(encoder_states):
            source, prefix, length = source_of(states), int(given[row]), int(lengths[row])
            self.redraft_prefixes.append((source, decoder_input[row, :prefix].tolist()))
            script = self.later[source] + [JUNK] * length
            tokens[row, prefix:length] = torch.tensor(script[prefix:length])
        return tokens, torch.zeros(tokens.shape)


def scripted_case(batch_size, seed, first_draft):
    """A verifier, a batch, its greedy outputs and a scripted drafter whose first draft of example i
    is `first_draft(i, greedy_i)` and whose re-drafts are the greedy outputs."""
    model = tiny_t5(seed)
    input_ids, attention_mask = random_batch(batch_size, seed=seed + 20)
    greedy = greedy_outputs(model, input_ids, attention_mask, BOUND)
    sources = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist())]
    drafter = ScriptedDrafter({s: first_draft(i, g) for i, (s, g) in enumerate(zip(sources, greedy))},
                              dict(zip(sources, greedy)))
    return model, input_ids, attention_mask, greedy, drafter


def corrupted(tokens, positions):
    return [JUNK + 1 + t % 5 if i in positions else t for i, t in enumerate(tokens)]


# ---- 1. exactness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
@pytest.mark.parametrize("redraft", [MISMATCH, OUTGROWN, NEVER, REALIGN])
def test_matches_sequential_with_a_random_drafter(batch_size, draft_tokens, redraft):
    model, drafter_model = tiny_t5(0), tiny_t5(7)
    drafter = build_decoder("nar", drafter_model.config, SPECIAL, iterations=3, max_new_tokens=BOUND).eval()
    input_ids, attention_mask = random_batch(batch_size, seed=3)
    out = aggressive(model, drafter, drafter_model, draft_tokens=draft_tokens, redraft=redraft).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    assert_consistent_telemetry(out, draft_tokens)


def test_a_drafter_with_several_length_candidates_drafts_its_chosen_ones():
    """With two length candidates per example the drafter reads back which one each example chose
    (one sync more per decode); the first call's offers are the chosen drafts' lengths, and the
    output stays greedy."""
    model, drafter_model = tiny_t5(0), tiny_t5(7)
    drafter = build_decoder("nar", drafter_model.config, SPECIAL, iterations=2, length_candidates=2,
                            max_new_tokens=BOUND).eval()
    input_ids, attention_mask = random_batch(8, seed=3)
    decoder = aggressive(model, drafter, drafter_model, draft_tokens=3, redraft=NEVER)
    with torch.no_grad():
        chosen = drafter.predict_outputs(drafter_model, encode(drafter_model, input_ids, attention_mask),
                                         attention_mask)
        state = decoder.begin_drafts(model, Source(input_ids, attention_mask, None, None)).state
    assert chosen.host_lengths is None and state.lengths == chosen.lengths.tolist()
    assert len(set(state.lengths)) > 1, "examples of different draft lengths"
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))


@pytest.mark.parametrize("draft_tokens", [2, 4])
def test_perfect_drafts_are_all_accepted(draft_tokens):
    model, input_ids, attention_mask, greedy, drafter = scripted_case(8, 1, lambda i, g: g)
    out = aggressive(model, drafter, SourceEcho(), draft_tokens=draft_tokens).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    assert_consistent_telemetry(out, draft_tokens)
    assert out.stats["redrafts"] == 0 and out.stats["drafter_passes"] == drafter.iterations
    assert out.stats["draft_tokens_accepted"] == out.stats["draft_tokens_offered"]
    # the first call verifies the draft's first tokens beside the start token: every call yields
    # draft_tokens + 1 tokens (the last one fewer)
    assert out.decoder_calls == [-(-len(g) // (draft_tokens + 1)) for g in greedy]
    assert len(set(out.decoder_calls)) > 1, "rows of different lengths"


def test_missed_drafts_are_drafted_again_after_the_verified_prefix():
    """Example i's first draft is wrong from token i on (none for the last): each row rejects at
    its own index, re-drafts once with its verified prefix given, and the output stays greedy."""
    batch = 8
    model, input_ids, attention_mask, greedy, drafter = scripted_case(
        batch, 2, lambda i, g: corrupted(g, range(i, len(g))) if i < batch - 1 else g)
    assert any(len(g) > 3 for g in greedy)
    out = aggressive(model, drafter, SourceEcho(), draft_tokens=3).generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    assert_consistent_telemetry(out, 3)
    missed = [i for i in range(batch - 1) if i < len(greedy[i])]
    assert out.stats["redrafts"] == len(missed)
    for source, prefix in drafter.redraft_prefixes:  # the verified prefix is what is given
        assert prefix == drafter.later[source][: len(prefix)]
    assert sorted(len(prefix) for _, prefix in drafter.redraft_prefixes) == sorted(i + 1 for i in missed)
    assert 0 < out.stats["draft_tokens_accepted"] < out.stats["draft_tokens_offered"]


def test_with_the_outgrown_rule_a_rejected_drafts_later_tokens_are_offered_as_they_are():
    """Example i's first draft has one wrong token, at index i (none for the last): with
    `redraft=outgrown` no row is drafted again, and the draft's tokens after the wrong one, right
    here, are accepted, so a row takes at most one call more than a perfect draft would; with the
    paper's rule every row that rejects a token is drafted again."""
    batch, draft_tokens = 8, 3
    model, input_ids, attention_mask, greedy, drafter = scripted_case(
        batch, 2, lambda i, g: corrupted(g, {i}) if i < batch - 1 else g)
    missed = [i for i in range(batch - 1) if i < len(greedy[i])]
    assert missed
    reference = sequential(model, BOUND).generate(model, input_ids, attention_mask)
    perfect_calls = [1 + -(-(len(g) - 1) // (draft_tokens + 1)) for g in greedy]

    out = aggressive(model, drafter, SourceEcho(), draft_tokens=draft_tokens, redraft=OUTGROWN).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, reference)
    assert_consistent_telemetry(out, draft_tokens)
    assert out.stats["redrafts"] == 0 and drafter.redraft_prefixes == []
    assert all(calls <= perfect + 1 for calls, perfect in zip(out.decoder_calls, perfect_calls))

    out = aggressive(model, drafter, SourceEcho(), draft_tokens=draft_tokens, redraft=MISMATCH).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, reference)
    assert out.stats["redrafts"] == len(missed)


def test_drafts_past_the_end_token_and_drafts_cut_short():
    """Even rows' drafts run 4 tokens past the end token (nothing past it is output); odd rows'
    drafts stop 2 tokens early, so the verifier outgrows them and they are drafted again."""
    def first_draft(i, g):
        return g + [JUNK] * 4 if i % 2 == 0 else g[: max(1, len(g) - 2)]
    model, input_ids, attention_mask, greedy, drafter = scripted_case(8, 4, first_draft)
    out = aggressive(model, drafter, SourceEcho(), draft_tokens=4).generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    assert_consistent_telemetry(out, 4)
    cut_short = [i for i in range(1, 8, 2) if len(greedy[i]) > 1]
    assert cut_short and out.stats["redrafts"] >= 1
    redrafted = {source for source, _ in drafter.redraft_prefixes}
    sources = list(drafter.later)
    assert all(sources[i] not in redrafted for i in range(0, 8, 2))  # long drafts never run out


def test_with_redraft_never_the_drafter_drafts_once_and_the_verifier_goes_on_alone_past_it():
    """Odd rows' drafts stop 2 tokens early, even rows' run past the end token, every drafted token
    right: with `redraft=never` no row is drafted again, a call takes a row's offered tokens and
    one more while its draft lasts, and past the draft's end one token."""
    draft_tokens = 4

    def first_draft(i, g):
        return g + [JUNK] * 4 if i % 2 == 0 else g[: max(1, len(g) - 2)]
    model, input_ids, attention_mask, greedy, drafter = scripted_case(8, 4, first_draft)
    out = aggressive(model, drafter, SourceEcho(), draft_tokens=draft_tokens, redraft=NEVER).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, BOUND).generate(model, input_ids, attention_mask))
    assert_consistent_telemetry(out, draft_tokens)
    assert out.stats["redrafts"] == 0 and drafter.redraft_prefixes == []
    assert out.stats["drafter_passes"] == drafter.iterations

    def calls(length: int, drafted: int) -> int:
        produced = made = 0
        while produced < length:
            produced += min(max(drafted - produced, 0), draft_tokens) + 1
            made += 1
        return made
    drafted = [len(first_draft(i, g)) for i, g in enumerate(greedy)]
    assert out.decoder_calls == [calls(len(g), d) for g, d in zip(greedy, drafted)]
    assert any(d < len(g) for g, d in zip(greedy, drafted)), "some row outgrows its draft"


def test_with_redraft_realign_a_draft_with_a_token_too_many_is_realigned_past_it():
    """Example r's draft is its greedy output with one wrong token put in at index i = r % m + 1:
    with `redraft=realign` no row is drafted again; the call that rejects it finds the verifier's
    token one place on and the draft goes on from there, so a row's first call stops at the wrong
    token and every later call takes m + 1 tokens (where the verifier's token is not also just
    before it); offered as it is (`never`), the draft is one place off and takes more calls."""
    m = 3

    def inserted(r, g):
        i = r % m + 1
        return g[:i] + [JUNK if g[min(i, len(g) - 1)] != JUNK else JUNK + 1] + g[i:]
    model, input_ids, attention_mask, greedy, drafter = scripted_case(8, 11, inserted)
    reference = sequential(model, BOUND).generate(model, input_ids, attention_mask)
    out = aggressive(model, drafter, SourceEcho(), draft_tokens=m, redraft=REALIGN).generate(
        model, input_ids, attention_mask)
    assert_same_output(out, reference)
    assert_consistent_telemetry(out, m)
    assert out.stats["redrafts"] == 0 and drafter.redraft_prefixes == []

    def realigned_calls(g, i):   # the first call keeps g[:i + 1], then m + 1 tokens a call
        return 1 + -(-(len(g) - i - 1) // (m + 1))
    cases = [(r, g, r % m + 1) for r, g in enumerate(greedy)]
    clear = [(r, g, i) for r, g, i in cases if len(g) > i + 1 and g[i] not in g[max(0, i - m):i]]
    assert len(clear) >= 2, "rows long enough, the verifier's token not just before the wrong one"
    assert [out.decoder_calls[r] for r, _, _ in clear] == [realigned_calls(g, i) for _, g, i in clear]
    as_it_is = aggressive(model, drafter, SourceEcho(), draft_tokens=m, redraft=NEVER).generate(
        model, input_ids, attention_mask)
    assert sum(out.decoder_calls) < sum(as_it_is.decoder_calls)


@pytest.mark.parametrize("redraft", [MISMATCH, OUTGROWN, NEVER, REALIGN])
def test_host_syncs_per_decode_under_every_redraft_rule(redraft):
    """Beside one sync per verifier call: the verifier's encoder and the final read-back, the
    drafter's own encoder and its predicted lengths, and under `realign` its draft, read once to be
    re-aligned on the host. A re-draft's decision and shapes come from host values: no sync."""
    from tasks.bench.sync_points import counting_sync_points
    model, drafter_model = tiny_t5(0), tiny_t5(7)
    drafter = build_decoder("nar", drafter_model.config, SPECIAL, iterations=1, max_new_tokens=BOUND).eval()
    input_ids, attention_mask = random_batch(8, seed=3)
    decoder = aggressive(model, drafter, drafter_model, draft_tokens=3, redraft=redraft)
    with torch.no_grad(), counting_sync_points() as counter:
        out = decoder.generate(model, input_ids, attention_mask)
    assert out.stats["redrafts"] > 0 or redraft in (NEVER, REALIGN)
    assert counter.count <= out.batch_decoder_calls + 4 + (redraft == REALIGN), counter.count


def test_alone_equals_batched():
    model, input_ids, attention_mask, greedy, drafter = scripted_case(
        6, 5, lambda i, g: corrupted(g, {i % 3 + 1}))
    decoder = aggressive(model, drafter, SourceEcho(), draft_tokens=3)
    batched = decoder.generate(model, input_ids, attention_mask)
    for i in range(6):
        n = int(attention_mask[i].sum())
        alone = decoder.generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        assert (alone.subsequences[0], alone.tokens[0], alone.decoder_calls[0]) == \
            (batched.subsequences[i], batched.tokens[i], batched.decoder_calls[i])


# ---- 2. relaxed acceptance ------------------------------------------------------------------------

def test_relaxed_acceptance_takes_a_runner_up_draft_token_exact_acceptance_does_not():
    """Each draft puts the verifier's runner-up token at index 2 of its greedy output: top_k = 2
    accepts it (leaving greedy decoding), top_k = 1 rejects it."""
    model = tiny_t5(6)
    input_ids, attention_mask = random_batch(8, seed=26)
    greedy = greedy_outputs(model, input_ids, attention_mask, BOUND)
    with torch.no_grad():
        decoder_input = decoder_inputs(model, torch.tensor([g[:3] + [0] * (3 - len(g[:3])) for g in greedy]))
        hidden = model(input_ids=input_ids, attention_mask=attention_mask,
                       decoder_input_ids=decoder_input, output_hidden_states=True).decoder_hidden_states[-1]
        runner_up = output_logits(model, hidden)[:, 2].topk(2).indices[:, 1].tolist()
    sources = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), attention_mask.sum(1).tolist())]
    long_enough = [i for i, g in enumerate(greedy) if len(g) > 3]
    assert long_enough
    first = {s: g[:2] + [runner_up[i]] + g[3:] if i in long_enough else g
             for i, (s, g) in enumerate(zip(sources, greedy))}
    drafter = ScriptedDrafter(first, dict(zip(sources, greedy)))
    reference = sequential(model, BOUND).generate(model, input_ids, attention_mask)
    exact = aggressive(model, drafter, SourceEcho(), draft_tokens=4).generate(model, input_ids, attention_mask)
    assert_same_output(exact, reference)
    relaxed = aggressive(model, drafter, SourceEcho(), draft_tokens=4, top_k=2).generate(
        model, input_ids, attention_mask)
    assert_consistent_telemetry(relaxed, 4)
    for i in long_enough:
        assert relaxed.subsequences[i] != reference.subsequences[i] or \
            relaxed.tokens[i] != reference.tokens[i]


# ---- 3. the drafter's given-prefix Mask-Predict ------------------------------------------------------

def test_given_positions_are_never_remasked():
    confidence = torch.tensor([[0.1, 0.2, 0.9, 0.3, 0.8, 0.0]])
    lengths, given = torch.tensor([5]), torch.tensor([2])
    first = tokens_to_remask(confidence, lengths, 0, 3, given)
    assert first.tolist() == [[False, False, True, True, True, False]]
    later = tokens_to_remask(confidence, lengths, 1, 3, given)   # floor(3 * 2 / 3) = 2 of the 3 free
    assert later.tolist() == [[False, False, False, True, True, False]]


def test_mask_predict_keeps_the_given_prefix():
    drafter_model = tiny_t5(3)
    drafter = build_decoder("nar", drafter_model.config, SPECIAL, iterations=3, max_new_tokens=12).eval()
    input_ids, attention_mask = random_batch(3, seed=8)
    from decoders.backbone import cross_attention_mask, encode
    with torch.no_grad():
        states = encode(drafter_model, input_ids, attention_mask)
        given, lengths = torch.tensor([0, 2, 5]), torch.tensor([6, 7, 6])
        prefix = torch.randint(5, VOCAB, (3, 7))
        positions = torch.arange(7)[None]
        decoder_input = torch.where(positions < given[:, None], prefix,
                                    torch.where(positions < lengths[:, None], SPECIAL.mask, SPECIAL.pad))
        tokens, _ = drafter.mask_predict(drafter_model, decoder_input, lengths, given, 3, states,
                                         cross_attention_mask(attention_mask, states.dtype))
    for row in range(3):
        assert tokens[row, : given[row]].tolist() == prefix[row, : given[row]].tolist()
        assert SPECIAL.mask not in tokens[row, given[row]: lengths[row]].tolist()
        assert (tokens[row, lengths[row]:] == SPECIAL.pad).all()


def test_decoding_without_a_drafter_is_refused():
    model = tiny_t5(0)
    decoder = build_decoder("aggressive", model.config, SPECIAL, max_new_tokens=BOUND)
    with pytest.raises(RuntimeError, match="no drafter"):
        decoder.generate(model, *random_batch(2))


def encoder_runs(model) -> list:
    """A list that receives an entry each time `model`'s encoder runs."""
    runs = []
    model.get_encoder().register_forward_hook(lambda *args: runs.append(1))
    return runs


def test_a_drafter_with_the_verifiers_encoder_drafts_from_its_states():
    """A drafter whose encoder is the verifier's (its decoder is another) drafts from the verifier's
    encoder states: its own encoder never runs, and it drafts, is verified and re-drafts exactly as
    it does running its encoder. One whose encoder differs by one weight runs its own."""
    model = tiny_t5(0)
    drafter_model = copy.deepcopy(model)
    with torch.no_grad():
        for weight in drafter_model.decoder.block.parameters():   # not the shared token embeddings
            weight.add_(0.5 * torch.randn_like(weight))
    drafter = build_decoder("nar", drafter_model.config, SPECIAL, iterations=2, max_new_tokens=BOUND).eval()
    input_ids, attention_mask = random_batch(8, seed=3)
    expected = sequential(model, BOUND).generate(model, input_ids, attention_mask)
    runs = encoder_runs(drafter_model)

    def decoded(verifier):
        decoder = build_decoder("aggressive", model.config, SPECIAL, max_new_tokens=BOUND, draft_tokens=3,
                                **ALWAYS_FEED)
        decoder.attach_drafter(drafter, drafter_model, verifier=verifier)
        runs.clear()
        out = decoder.generate(model, input_ids, attention_mask)
        assert_same_output(out, expected)
        return out, decoder.attached.shares_encoder, len(runs)

    shared, shares, shared_runs = decoded(model)
    own, owns, own_runs = decoded(None)
    assert shares and shared_runs == 0
    assert not owns and own_runs == 1
    assert shared.decoder_calls == own.decoder_calls
    assert {k: v for k, v in shared.stats.items() if k != "drafter_seconds"} == \
        {k: v for k, v in own.stats.items() if k != "drafter_seconds"}
    assert shared.stats["redrafts"] > 0, "re-drafts read the shared states too"

    with torch.no_grad():
        drafter_model.encoder.block[0].layer[1].DenseReluDense.wo.weight[0, 0] += 1.0
    _, shares_other, other_runs = decoded(model)
    assert not shares_other and other_runs == 1


# ---- 4. the tasks layer: the drafter checkpoint -----------------------------------------------------

@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    """Untrained sequential and nar checkpoints of the same configuration (one tokenizer), and a
    nar checkpoint whose stored tokenizer is another."""
    from tests.test_predict import saved
    folder = tmp_path_factory.mktemp("aggressive")
    sequential_ckpt = saved(folder / "sequential", "keyphrase", "sequential")
    nar_ckpt = saved(folder / "nar", "keyphrase", "nar")
    other = torch.load(nar_ckpt.path, weights_only=True)
    other["tokenizer_json"] = other["tokenizer_json"].replace('"unk_token"', '"unk_token_other"', 1)
    assert other["tokenizer_json"] != torch.load(nar_ckpt.path, weights_only=True)["tokenizer_json"]
    other_path = folder / "other-tokenizer.ckpt"
    torch.save(other, other_path)
    return SimpleNamespace(sequential=sequential_ckpt, nar=nar_ckpt.path, other_tokenizer=str(other_path))


def refused_by_test(argv, monkeypatch, capsys) -> str:
    """stderr of tasks.test run as its command line: exit code 2, one message, nothing built."""
    from tasks import cli, test as test_entry
    from tasks.runs import restore, trainer
    monkeypatch.setattr(trainer, "build", lambda *a, **k: pytest.fail("built before refusing"))
    monkeypatch.setattr(restore, "build", lambda *a, **k: pytest.fail("built before refusing"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main_guard(lambda: test_entry.main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("drafter,message", [
    (None, "decoder=aggressive needs a drafter: set decoder.drafter=NAR_CKPT"),
    ("missing", "no such checkpoint file"),
    ("sequential", "was trained with decoder 'sequential'; the aggressive decoder drafts with a nar checkpoint"),
    ("other_tokenizer", "has another tokenizer than the checkpoint it drafts for"),
])
def test_a_bad_drafter_is_refused_before_any_work(drafter, message, saved_checkpoints, tmp_path,
                                                  monkeypatch, capsys):
    paths = {"missing": str(tmp_path / "nowhere.ckpt"), "sequential": saved_checkpoints.sequential.path,
             "other_tokenizer": saved_checkpoints.other_tokenizer}
    argv = ["--ckpt", saved_checkpoints.sequential.path, "decoder=aggressive"]
    if drafter is not None:
        argv.append(f"decoder.drafter={paths[drafter]}")
    assert message in refused_by_test(argv, monkeypatch, capsys)


def test_fit_refuses_the_aggressive_decoder_and_names_the_way(tmp_path, monkeypatch, capsys):
    from tasks import fit
    from tests.test_faults import fails_before_any_work
    from tests.test_end_to_end import TINY, tracking
    stderr = fails_before_any_work(fit, ["--decoder", "aggressive", *TINY, *tracking(tmp_path)],
                                   tmp_path, monkeypatch, capsys)
    assert "tasks.test --ckpt SEQUENTIAL_CKPT decoder=aggressive decoder.drafter=NAR_CKPT" in stderr


@pytest.mark.parametrize("decoders,extra,message", [
    ("sequential,aggressive", [], "decoder aggressive drafts with a nar model, and this comparison "
                                  "has none: add nar to --decoders"),
    ("sequential,nar,aggressive", ["decoder.drafter=n.ckpt"],
     "decoder.drafter: in tasks.compare decoder aggressive drafts with the nar row's model"),
])
def test_compare_refuses_an_aggressive_row_without_its_nar_row_before_any_work(
        decoders, extra, message, tmp_path, monkeypatch, capsys):
    from tasks import compare
    from tests.test_faults import fails_before_any_work
    from tests.test_end_to_end import TINY, tracking
    monkeypatch.setattr(compare, "train_and_test", lambda *a, **k: pytest.fail("trained a row"))
    stderr = fails_before_any_work(compare, ["--decoders", decoders, *TINY, *extra, *tracking(tmp_path)],
                                   tmp_path, monkeypatch, capsys)
    assert message in stderr and "--ckpt nar=NAR_CKPT" in stderr


def test_compare_refuses_checkpoints_with_other_tokenizers_before_any_work(
        saved_checkpoints, tmp_path, monkeypatch, capsys):
    from tasks import compare
    from tests.test_faults import fails_before_any_work
    from tests.test_end_to_end import TINY, tracking
    monkeypatch.setattr(compare, "train_and_test", lambda *a, **k: pytest.fail("trained a row"))
    stderr = fails_before_any_work(compare, [
        "--decoders", "sequential,nar,aggressive", "--ckpt", f"sequential={saved_checkpoints.sequential.path}",
        "--ckpt", f"nar={saved_checkpoints.other_tokenizer}", *TINY, "model.initializer_factor=6",
        *tracking(tmp_path)], tmp_path, monkeypatch, capsys)
    assert "have different tokenizers; a drafter and its verifier must share one" in stderr


def test_compare_drafts_with_the_nar_row_and_verifies_with_the_sequential_row(
        saved_checkpoints, tmp_path, monkeypatch):
    """sequential and nar from --ckpt, aggressive between them in the plan: its rows decode the
    sequential row's model with the nar row's checkpoint as drafter, the exact one predicting what
    sequential predicts; top_k > 1 is labelled inexact; draft counters per call in JSON and table."""
    from mlflow.tracking import MlflowClient
    from tasks import compare
    from tests.test_end_to_end import TINY, run_artifact_rows, tracking
    monkeypatch.setattr(compare, "train_and_test", lambda *a, **k: pytest.fail("trained a row"))
    sequential_ckpt, nar_ckpt = saved_checkpoints.sequential.path, saved_checkpoints.nar
    out = tmp_path / "cmp.json"
    result = compare.main(["--decoders", "sequential,aggressive,nar", "--ckpt", f"sequential={sequential_ckpt}",
                           "--ckpt", f"nar={nar_ckpt}", "--sweep", "decoder.top_k=1,3",
                           "--out", str(out), "--repeats", "1", "--speed-examples", "2",
                           *TINY, "model.initializer_factor=6", *tracking(tmp_path)])
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == ["sequential", "aggressive(top_k=1)", "aggressive(top_k=3)", "nar"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    def predictions(label):
        return [r["prediction"] for r in run_artifact_rows(client, rows[label]["mlflow_run_id"],
                                                           tmp_path / label)]
    assert predictions("aggressive(top_k=1)") == predictions("sequential")
    for label in ("aggressive(top_k=1)", "aggressive(top_k=3)"):
        params = client.get_run(rows[label]["mlflow_run_id"]).data.params
        assert (params["decoder.drafter"], params["train.init_from"]) == (nar_ckpt, sequential_ckpt)
        assert rows[label]["training"] == "none: sequential model, nar row's drafter"
        counters = rows[label]["counters_per_call"]
        assert 0 <= counters["draft_tokens_accepted"] <= counters["draft_tokens_offered"]
        assert counters["redrafts"] >= 0 and counters["drafts_cut_at_separator"] >= 0
        assert 0 < rows[label]["decode_time_shares"]["drafter_seconds"] < 1
    assert [rows[label]["inexact"] for label in rows] == [False, False, True, False]
    assert rows["sequential"]["counters_per_call"] == rows["nar"]["counters_per_call"] == {}
    table = out.with_suffix(".md").read_text()
    assert "| aggressive(top_k=3) (inexact)" in table and "aggressive(top_k=1) (inexact)" not in table
    assert "draft_tokens_offered/call" in table and "drafter_seconds share of decode time" in table


def restored_aggressive(saved_checkpoints, drafter: str):
    from tasks.runs.checkpoints import load_checkpoint
    from tasks.runs.restore import checkpoint_config, restore_module
    path = saved_checkpoints.sequential.path
    checkpoint = load_checkpoint(path)
    cfg = checkpoint_config(checkpoint, path, ["decoder=aggressive", f"decoder.drafter={drafter}",
                                               "decoder.draft_tokens=3"])
    return restore_module(checkpoint, path, cfg).eval()


def test_a_restored_aggressive_module_drafts_with_the_nar_checkpoint(saved_checkpoints):
    from tasks.runs.checkpoints import load_checkpoint
    from tasks.runs.restore import checkpoint_config, restore_module
    module = restored_aggressive(saved_checkpoints, saved_checkpoints.nar)
    assert module.decoder.attached.decoder.name == "nar"
    path = saved_checkpoints.sequential.path
    checkpoint = load_checkpoint(path)
    verifier = restore_module(checkpoint, path, checkpoint_config(checkpoint, path, [])).eval()
    input_ids, attention_mask = random_batch(4, seed=2)
    input_ids = input_ids % verifier.backbone.config.vocab_size
    out = module.decoder.generate(module.backbone, input_ids, attention_mask)
    ref = verifier.decoder.generate(verifier.backbone, input_ids, attention_mask)
    assert out.subsequences == ref.subsequences and out.tokens == ref.tokens


def test_a_restored_drafter_shares_the_verifiers_encoder_only_where_it_is_the_same(saved_checkpoints,
                                                                                   tmp_path):
    """The tasks layer attaches the drafter for the module's backbone: the two untrained
    checkpoints, built from one seed, have one encoder, which the drafter then shares; a drafter
    checkpoint with one encoder weight changed keeps its own."""
    assert restored_aggressive(saved_checkpoints, saved_checkpoints.nar).decoder.attached.shares_encoder
    other = torch.load(saved_checkpoints.nar, weights_only=True)
    other["state_dict"]["backbone.encoder.block.0.layer.0.SelfAttention.q.weight"][0, 0] += 1.0
    torch.save(other, tmp_path / "other-encoder.ckpt")
    module = restored_aggressive(saved_checkpoints, str(tmp_path / "other-encoder.ckpt"))
    assert not module.decoder.attached.shares_encoder
