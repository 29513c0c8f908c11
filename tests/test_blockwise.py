"""Blockwise parallel decoding: exact acceptance reproduces sequential greedy decoding token for
token (alone and in batches where rows accept different lengths), the acceptance rule itself, one
host sync per decoder call, a self-attention cache no longer than the longest live row and holding
the right states, the summed k-head loss, and checkpoint compatibility with the sequential decoder."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from decoders import available, build_decoder, decoder_class
from decoders.backbone import output_logits, run_decoder
from decoders.base import Decoder
from decoders.draft_policy import COMPARISONS_KEPT, DECODES_TO_COMPARE, Tally
from decoders.drafts import accepted_length, kept_tokens
from tasks.bench.sync_points import counting_sync_points
from tests.conftest import (ALWAYS_FEED, SPECIAL, VOCAB, assert_alone_equals_batched, assert_drafts_counted,
                            assert_same_output, briefly_trained, first_batch_where, random_batch, sequential, tiny_t5)

pytestmark = [pytest.mark.float64, pytest.mark.numerics]  # see tests/conftest.py

EOS = SPECIAL.eos


def blockwise(model, **options):
    return build_decoder("blockwise", model.config, SPECIAL, **{**ALWAYS_FEED, **options})


def randomise_heads(decoder, seed):
    """Fresh heads are copies of the base head (W2 = 0); random W2 makes them propose garbage."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        decoder.heads.w2.copy_(torch.randn(decoder.heads.w2.shape, generator=g))
    return decoder


# ---- 1. exactness against the sequential decoder -----------------------------------------------

@pytest.mark.parametrize("seed,block_size,random_heads", [(0, 4, True), (1, 2, True), (2, 4, True),
                                                         (3, 3, False)])
def test_matches_sequential_on_random_models(seed, block_size, random_heads):
    model = tiny_t5(seed)
    input_ids, attention_mask = random_batch(6, seed=seed + 10)
    decoder = blockwise(model, block_size=block_size, max_new_tokens=15)
    if random_heads:
        randomise_heads(decoder, seed)
    out = decoder.generate(model, input_ids, attention_mask)
    ref = sequential(model, 15).generate(model, input_ids, attention_mask)
    assert_same_output(out, ref)
    assert_drafts_counted(out, decoder.draft_width)
    for i in range(0, 6, 2):  # unbatched, unpadded
        n = int(attention_mask[i].sum())
        alone = decoder.generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        assert_same_output(alone, sequential(model, 15).generate(model, input_ids[i:i + 1, :n],
                                                                  attention_mask[i:i + 1, :n]))


@pytest.fixture(scope="module")
def trained():
    """A tiny T5 and blockwise heads trained together briefly with the blockwise loss."""
    model = tiny_t5(0, initializer_factor=1.0)  # T5's own init scale: heads that learn to propose
    decoder = build_decoder("blockwise", model.config, SPECIAL, max_new_tokens=20, **ALWAYS_FEED)
    model = briefly_trained(decoder, model=model)
    return model, decoder.eval()


def exercised_batch(model, decoder):
    """The first seeded batch of 8 on which the trained blockwise decoder accepts proposals."""
    def exercised(input_ids, attention_mask):
        """acceptance really exercised: more than one token per call on average, rows of the
        same batch accepting different amounts (so the per-row cache masking matters), and rows
        leaving the batch at different calls"""
        out = decoder.generate(model, input_ids, attention_mask)
        return (sum(out.tokens) / sum(out.decoder_calls) > 1
                and len({t - c for t, c in zip(out.tokens, out.decoder_calls)}) > 1
                and len(set(out.decoder_calls)) > 1)
    return first_batch_where(exercised, 8, max_len=9, seed=77)


def test_matches_sequential_after_training_and_accepts_proposals(trained):
    model, decoder = trained
    input_ids, attention_mask = exercised_batch(model, decoder)
    out = decoder.generate(model, input_ids, attention_mask)
    ref = sequential(model, 20).generate(model, input_ids, attention_mask)
    assert_same_output(out, ref)
    assert_drafts_counted(out, decoder.draft_width)
    # Unbatched, against sequential decoding of the same unpadded input: on this trained model the
    # encoder output of a padded row drifts by ~1e-2 from the unpadded one (a T5/fixture effect that
    # changes near-tie argmaxes for the sequential decoder as well), so alone vs batch is compared on
    # random models in test_alone_equals_in_batch instead.
    for i in range(8):
        n = int(attention_mask[i].sum())
        alone = decoder.generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        alone_ref = sequential(model, 20).generate(model, input_ids[i:i + 1, :n], attention_mask[i:i + 1, :n])
        assert_same_output(alone, alone_ref)
        assert_drafts_counted(alone, decoder.draft_width)


def test_a_measured_decode_runs_the_loop_measured_faster(trained):
    """Measured (`min_acceptance` null, the default): once both loops were timed at a batch size,
    a decode runs the one measured faster per output token (`LoopChoice`). Sequential decoding of
    the base head gives the verify loop's tokens in sequential's calls, feeds no draft, times no
    call and leaves the drafts' tally as it was; the verify loop, measured faster, feeds drafts."""
    model, always_feeding = trained
    assert decoder_class("blockwise").defaults()["min_acceptance"] is None
    decoder = copy.deepcopy(always_feeding)
    decoder.min_acceptance = None
    input_ids, attention_mask = exercised_batch(model, always_feeding)
    rows, expected = len(input_ids), sequential(model, 20).generate(model, input_ids, attention_mask)
    record = decoder.feeding_record(input_ids.device)
    for verifies, seconds in ((True, 2.0), (False, 1.0)):
        for _ in range(DECODES_TO_COMPARE):
            record.loops.add(rows, verifies, seconds)
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, expected)
    assert (out.decoder_calls, out.batch_decoder_calls) == (expected.decoder_calls, expected.batch_decoder_calls)
    assert not any(out.stats.values()) and record.drafts == Tally(None) and not record.costs.seconds
    assert record.loops.decodes[rows] == 2 * DECODES_TO_COMPARE + 1   # timed as sequential decoding
    assert list(record.loops.seconds[rows, True]) == [2.0] * DECODES_TO_COMPARE
    # revisits of the verify loop, twice as fast as sequential decoding's latest decodes, outvote it
    for _ in range(COMPARISONS_KEPT // 2 + 1):
        record.loops.add(rows, True, 0.5)
    out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, expected)
    assert out.stats["draft_tokens_accepted"] > 0 and record.drafts.tries > 0


# ---- 2. the acceptance rule ---------------------------------------------------------------------

def test_accepted_length_exact():
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 9, 7]])
    base = torch.tensor([[9, 6, 7],     # first proposal rejected: 0
                         [5, 6, 8],     # partial: 2
                         [5, 6, 7],     # whole block: 3
                         [5, 6, 7]])    # a later agreement after a mismatch does not count: 1
    assert accepted_length(proposals, base).tolist() == [0, 2, 3, 1]               # argmax (B, m)
    assert accepted_length(proposals, base[..., None]).tolist() == [0, 2, 3, 1]    # top-1 (B, m, 1)


def test_accepted_length_top_k():
    proposals = torch.tensor([[5, 6, 7]])
    top2 = torch.tensor([[[4, 5], [6, 8], [8, 9]]])  # (B, m, top_k): 5 and 6 are among the top 2
    assert accepted_length(proposals, top2).tolist() == [2]
    assert accepted_length(proposals, top2[..., :1]).tolist() == [0]


def test_accepted_length_counts_only_offered_drafts():
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    base = torch.tensor([[5, 6, 7]] * 3)
    offered = torch.tensor([3, 1, 0])   # filler after the offered tokens is never accepted
    assert accepted_length(proposals, base[..., None], offered).tolist() == [3, 1, 0]


@pytest.mark.parametrize("accepted,first_end,room,kept,ended", [
    (0, 1, 10, 1, False),     # nothing accepted: the model's own token only
    (2, 3, 10, 3, False),     # two accepted, then the model's own token
    (3, 4, 10, 4, False),     # the whole block
    (3, 1, 10, 2, True),      # an accepted end token ends the row: what follows it is dropped
    (2, 2, 10, 3, True),      # the model's own token is the end token
    (2, 3, 10, 3, False),     # an end token among the rejected drafts does not count (index 3 > 2)
    (3, 4, 2, 2, False),      # max_new_tokens cuts the block, before an end token
    (3, 2, 2, 2, False),      # ... or exactly at one (index 2 is past the room)
    (3, 1, 2, 2, True),       # an end token inside the room still ends it
])
def test_kept_tokens(accepted, first_end, room, kept, ended):
    assert kept_tokens(accepted, first_end, room) == (kept, ended)


CHAIN = [10, 11, 12, 13, 14, 15, 16, 17, EOS]  # what the rigged model greedily decodes


def rigged_model(chain=CHAIN):
    """A T5 whose decoder ignores context (attention outputs zeroed), so its next token is a fixed
    function `successor` of the current one, with an output layer rigged so that greedy decoding
    from the start token yields `chain` (distinct tokens)."""
    model = tiny_t5(0)
    # untie the output layer from the embeddings, so rigging it leaves the decoder's states alone
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        for block in model.decoder.block:
            block.layer[0].SelfAttention.o.weight.zero_()
            block.layer[1].EncDecAttention.o.weight.zero_()
        hidden = model.decoder(input_ids=torch.arange(VOCAB)[:, None],
                               encoder_hidden_states=torch.zeros(VOCAB, 1, model.config.d_model)
                               ).last_hidden_state[:, 0]                      # (V, d): state of each token
        # row successor(t) of the output layer points along t's state: argmax = successor (Cauchy-Schwarz)
        model.lm_head.weight.zero_()
        for current, nxt in zip([SPECIAL.start] + chain[:-1], chain):
            model.lm_head.weight[nxt] = 100 * hidden[current] / hidden[current].norm()
        successor = output_logits(model, hidden).argmax(-1)                   # (V,)
    return model, successor


def rig_heads(decoder, successor, wrong_at=None):
    """Stub heads that know the future: from the state at t they propose the true tokens t+2..t+k
    (iterating the successor map from the base head's own prediction), except a wrong token at
    proposal index `wrong_at`."""
    def proposal_logits(model, hidden, stacked=None):                          # hidden: (B, d)
        token = output_logits(model, hidden).argmax(-1)                        # (B,) = token t+1
        proposals = []
        for i in range(decoder.block_size - 1):
            token = successor[token]
            proposals.append((token + 1) % VOCAB if i == wrong_at else token)
        return F.one_hot(torch.stack(proposals, -1), VOCAB).float()            # (B, k-1, V)
    decoder.proposal_logits = proposal_logits
    return decoder


def run_rigged(block_size, wrong_at=None, max_new_tokens=20, top_k=1):
    model, successor = rigged_model()
    input_ids, attention_mask = random_batch(3, seed=5)
    decoder = rig_heads(blockwise(model, block_size=block_size, max_new_tokens=max_new_tokens,
                                  top_k=top_k), successor, wrong_at)
    return decoder.generate(model, input_ids, attention_mask), model, input_ids, attention_mask


def test_rigged_model_decodes_the_chain():
    model, _ = rigged_model()
    input_ids, attention_mask = random_batch(3, seed=5)
    ref = sequential(model, 20).generate(model, input_ids, attention_mask)
    assert ref.tokens == [len(CHAIN)] * 3 and ref.subsequences == [[CHAIN[:-1]]] * 3


@pytest.mark.parametrize("block_size", [3, 4, 5])
def test_full_acceptance(block_size):
    """Perfect proposals: the first call yields 1 token, every later one k (for k = 3 and 5 the last
    block crosses the end token; what follows it is discarded)."""
    out, *_ = run_rigged(block_size)
    assert out.subsequences == [[CHAIN[:-1]]] * 3
    assert out.tokens == [len(CHAIN)] * 3
    expected_calls = 1 + -(-(len(CHAIN) - 1) // block_size)
    assert out.decoder_calls == [expected_calls] * 3 and out.batch_decoder_calls == expected_calls
    later_calls = 3 * (expected_calls - 1)     # every call of the 3 rows after their first
    offered = (block_size - 1) * later_calls
    assert out.stats == {"draft_tokens_offered": offered, "draft_tokens_accepted": offered,
                         "calls_with_draft": later_calls, "drafts_cut_at_separator": 0}


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_partial_and_no_acceptance(wrong_at):
    """A wrong proposal at index j: exactly j proposals accepted per call (j = 0: none, like
    sequential decoding), and the output is still the greedy chain."""
    out, *_ = run_rigged(4, wrong_at=wrong_at)
    assert out.subsequences == [[CHAIN[:-1]]] * 3
    calls = 1 + -(-(len(CHAIN) - 1) // (wrong_at + 1))
    assert out.decoder_calls == [calls] * 3
    # the loop counts the 3 proposals of every later call, and the j accepted of them
    assert out.stats["draft_tokens_offered"] == 3 * 3 * (calls - 1)
    assert out.stats["draft_tokens_accepted"] == wrong_at * 3 * (calls - 1)


def test_max_new_tokens_cuts_inside_a_block():
    out, *_ = run_rigged(4, max_new_tokens=6)
    assert out.subsequences == [[CHAIN[:6]]] * 3
    assert out.tokens == [6] * 3 and out.decoder_calls == [3] * 3 and out.bound_hit == [True] * 3


def test_top_k_approximate_acceptance():
    """With top_k = vocabulary size every proposal passes, even wrong ones: k tokens per call and an
    output that is no longer the greedy one (the trade-off of Section 5)."""
    out, *_ = run_rigged(4, wrong_at=1, top_k=VOCAB)
    assert out.decoder_calls == [1 + -(-(len(CHAIN) - 1) // 4)] * 3
    assert out.subsequences[0] != [CHAIN[:-1]]
    exact, *_ = run_rigged(4, wrong_at=1, top_k=1)
    assert exact.subsequences == [[CHAIN[:-1]]] * 3


# ---- 3. lean decoding: host syncs, the cache's bound and content ---------------------------------

def test_one_host_sync_per_decoder_call(trained):
    """The stop check is the only host sync in the loop; the encoder (inside transformers) and the
    final read-back of the results add one each per generate."""
    model, decoder = trained
    input_ids, attention_mask = exercised_batch(model, decoder)   # decodes: lazy inits are done
    with counting_sync_points() as counter:
        out = decoder.generate(model, input_ids, attention_mask)
    assert counter.count <= out.batch_decoder_calls + 2


LONG_CHAIN = list(range(10, 50)) + [EOS]


def test_a_call_attends_to_no_more_than_the_longest_live_row():
    """Rows that accept in turns: at every call one row accepts its whole block and another none,
    so the batch maximum of accepted tokens grows by about (k + 1) / 2 per call while some row
    always fills a whole block. Each call must attend to no more self-attention slots than the live
    row with the most tokens produced so far needs (its count, plus the fed block: the bound in
    decoders/drafts.py), and the cache buffer must hold at most twice that (it grows by doubling)
    beyond its first size. On the rigged model the first fed token of a row tells how many tokens it
    has produced (its index in the chain + 1; the start token: 0)."""
    model, successor = rigged_model(LONG_CHAIN)
    k = 4
    decoder = blockwise(model, block_size=k, max_new_tokens=len(LONG_CHAIN))
    calls = [0]

    def proposal_logits(model, hidden, stacked=None):                        # hidden: (live, d)
        token = output_logits(model, hidden).argmax(-1)                      # (live,) = token t+1
        proposals = []
        for _ in range(k - 1):
            token = successor[token]
            proposals.append(token)
        proposals = torch.stack(proposals, -1)                               # (live, k-1): all true
        wrong = (torch.arange(len(proposals)) + calls[0]) % 2 == 1           # every other row, in turns
        proposals[wrong, 0] = (proposals[wrong, 0] + 1) % VOCAB              # first one wrong: none accepted
        calls[0] += 1
        return F.one_hot(proposals, VOCAB).float()
    decoder.proposal_logits = proposal_logits

    seen = []  # per call: (slots attended, buffer slots, fed width, tokens produced by each live row)

    def recording_run_decoder(model, input_ids, self_bias, encoder_states, encoder_mask, cache, slots,
                              positions):
        first = input_ids[:, 0].tolist()
        produced = [0 if t == SPECIAL.start else LONG_CHAIN.index(t) + 1 for t in first]
        hidden = run_decoder(model, input_ids, self_bias, encoder_states, encoder_mask, cache, slots,
                             positions)
        seen.append((self_bias.size(-1), cache.held(), input_ids.size(1),
                     produced))
        return hidden

    input_ids, attention_mask = random_batch(3, seed=5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "model_step", lambda: recording_run_decoder)
        out = decoder.generate(model, input_ids, attention_mask)
    assert out.subsequences == [[LONG_CHAIN[:-1]]] * 3                      # still the greedy chain
    assert len(seen) == out.batch_decoder_calls
    # not vacuous: the live rows were at different lengths at 8 or more calls
    assert sum(max(produced) > min(produced) for *_, produced in seen) >= 8
    assert seen[-1][1] > seen[0][1]                                          # the buffer grew
    for call, (attended, buffer, fed, produced) in enumerate(seen):
        assert attended == max(produced) + fed, f"call {call}: {attended} slots for rows at {produced}"
        assert buffer <= max(2 * attended, 16 + k), f"call {call}: buffer of {buffer} slots"


def test_every_accepted_state_equals_the_teacher_forced_one():
    """The compacted cache holds the right keys at the right places: at every call, the decoder
    state of every fed position a row keeps equals the state of a plain (uncached) decoder run over
    the row's greedy output, on a random model whose states depend on the whole context. Oracle
    heads make row r accept (r + call) % k proposals, so live rows sit at different lengths and the
    compaction moves slots at most calls."""
    model = tiny_t5(0)
    k, bound = 4, 20

    def greedy(input_ids, attention_mask):
        """per example: b, y_1, ... up to and including its end token (or the bound)"""
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=bound).tolist()
        return [row[: row.index(EOS, 1) + 1] if EOS in row[1:] else row for row in out]

    def varied(input_ids, attention_mask):
        """rows end at 3 or more different lengths and 2 or more run to the bound (rows leave the
        batch while others go on being compacted)"""
        lengths = [len(seq) for seq in greedy(input_ids, attention_mask)]
        return len(set(lengths)) >= 3 and lengths.count(bound + 1) >= 2
    input_ids, attention_mask = first_batch_where(varied, 6, seed=20)
    sequences = greedy(input_ids, attention_mask)
    with torch.no_grad():
        encoder_states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        teacher = [model.decoder(input_ids=torch.tensor([seq]), encoder_hidden_states=encoder_states[r:r + 1],
                                 encoder_attention_mask=attention_mask[r:r + 1]).last_hidden_state[0]
                   for r, seq in enumerate(sequences)]                      # (len, d) per example

    position = [0] * len(sequences)   # per example: tokens produced so far = position of fed[:, 0]
    next_proposals = []               # per row of the call, for the heads: (example, its new position)
    calls, moved_calls, compared = [0], [0], [0]

    def checking_run_decoder(model, fed, self_bias, live_states, *args, **kwargs):
        hidden = run_decoder(model, fed, self_bias, live_states, *args, **kwargs)  # (live, Q, d)
        calls[0] += 1
        # which example each live row is: the one whose encoder output it carries
        examples = [(row - encoder_states).abs().flatten(1).amax(1).argmin().item() for row in live_states]
        moved_calls[0] += len({position[r] for r in examples}) > 1
        next_proposals.clear()
        for i, (r, block) in enumerate(zip(examples, fed.tolist())):
            seq, n = sequences[r], position[r]
            assert block[0] == seq[n]
            accepted = 0
            while accepted + 1 < len(block) and n + accepted + 1 < len(seq) \
                    and block[accepted + 1] == seq[n + accepted + 1]:
                accepted += 1
            for j in range(accepted + 1):                                    # the kept positions
                if n + j < len(seq):
                    torch.testing.assert_close(hidden[i, j], teacher[r][n + j], rtol=0, atol=1e-9)
                    compared[0] += 1
            position[r] = n + accepted + 1
            # the heads draft for every row of the call, before the sync that tells which go on
            next_proposals.append((r, position[r]))
        return hidden

    def oracle_proposal_logits(model, hidden, stacked=None):                 # hidden: (live, d)
        proposals = []
        for r, n in next_proposals:
            seq = sequences[r]
            right = (r + calls[0]) % k                                       # proposals to get right
            row = [seq[n + 1 + j] if n + 1 + j < len(seq) else 5 for j in range(k - 1)]
            proposals.append([t if j < right else (t + 1) % VOCAB for j, t in enumerate(row)])
        return F.one_hot(torch.tensor(proposals), VOCAB).to(hidden.dtype)

    decoder = blockwise(model, block_size=k, max_new_tokens=bound)
    decoder.proposal_logits = oracle_proposal_logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "model_step", lambda: checking_run_decoder)
        out = decoder.generate(model, input_ids, attention_mask)
    assert_same_output(out, sequential(model, bound).generate(model, input_ids, attention_mask))
    # not vacuous: live rows at different lengths at most calls, many states compared
    assert moved_calls[0] >= out.batch_decoder_calls // 2 and compared[0] >= sum(out.tokens)
    assert len({t - c for t, c in zip(out.tokens, out.decoder_calls)}) > 1


# ---- 4. alone equals in a batch -----------------------------------------------------------------

def test_alone_equals_in_batch():
    model = tiny_t5(1)
    input_ids, attention_mask = random_batch(5, seed=3)
    decoder = randomise_heads(blockwise(model, block_size=3, max_new_tokens=12), 7)
    assert_alone_equals_batched(decoder, model, input_ids, attention_mask)


# ---- 5. loss ------------------------------------------------------------------------------------

TARGETS = [[[7, 8], [9, 10, 11]], [[12]]]


def test_loss_is_base_plus_head_cross_entropies():
    model = tiny_t5(0)
    input_ids, attention_mask = random_batch(2, seed=4)
    decoder = randomise_heads(blockwise(model, block_size=4), 1)
    layout = decoder.layout(TARGETS)
    labels = layout["labels"]
    assert labels.tolist() == sequential(model, 20).layout(TARGETS)["labels"].tolist()
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
    hidden = out.decoder_hidden_states[-1]                                    # (B, T, d), final state
    assert torch.allclose(output_logits(model, hidden), out.logits, atol=1e-5)
    expected = out.loss
    for i in range(1, len(decoder.heads) + 1):  # head i: state at t -> labels[t + i]
        logits = output_logits(model, decoder.heads.head(i - 1, hidden[:, :-i]))
        expected = expected + F.cross_entropy(logits.flatten(0, 1), labels[:, i:].flatten(),
                                              ignore_index=-100)
    loss = decoder.loss(model, input_ids, attention_mask, layout)
    assert torch.allclose(loss, expected, atol=1e-5)


def test_freeze_backbone_trains_only_heads():
    model = tiny_t5(0)
    input_ids, attention_mask = random_batch(2, seed=4)
    decoder = randomise_heads(blockwise(model, freeze_backbone=True), 1)
    layout = decoder.layout(TARGETS)
    loss = decoder.loss(model, input_ids, attention_mask, layout)
    loss.backward()
    assert all(p.grad is None for p in model.parameters())  # shared output projection included
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in decoder.parameters())
    unfrozen = blockwise(model)
    unfrozen.load_state_dict(decoder.state_dict())
    assert torch.allclose(loss, unfrozen.loss(model, input_ids, attention_mask, layout))


def test_heads_are_submodules_and_start_as_the_base_head():
    model = tiny_t5(0)
    decoder = blockwise(model, block_size=5)
    assert len(decoder.heads) == 4
    d_model, d_ff = model.config.d_model, model.config.d_ff
    assert {name: tuple(p.shape) for name, p in decoder.state_dict().items()} == {
        "heads.w1": (4 * d_ff, d_model), "heads.w2": (4, d_model, d_ff)}    # stacked, W2 zero
    hidden = torch.randn(3, model.config.d_model)
    proposals = decoder.proposal_logits(model, hidden)                       # (3, k-1, V)
    assert proposals.shape == (3, 4, model.config.vocab_size)
    # the same values (all heads run as one batched matmul, which may round in another order)
    torch.testing.assert_close(proposals, output_logits(model, hidden)[:, None].expand(-1, 4, -1),
                               rtol=1e-12, atol=1e-12)


def test_a_decode_runs_the_heads_on_their_weights_without_copying_them():
    """The heads' stacked weights are the parameters themselves: no operation of a decode makes a
    tensor the size of a stacked W1 or W2 (a copy per decode costs 2 (k-1) d_model d_ff numbers)
    other than a view of them."""
    model = tiny_t5(0)
    decoder = randomise_heads(blockwise(model, max_new_tokens=20), 1)
    weights = (decoder.heads.w1, decoder.heads.w2)
    sizes = {w.numel() for w in weights}
    storages = {w.untyped_storage().data_ptr() for w in weights}
    input_ids, attention_mask = random_batch(3, seed=2)

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [t.numel() for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor)
                          and t.untyped_storage().data_ptr() not in storages]
            return out
    with torch.no_grad(), Sizes() as seen:
        out = decoder.generate(model, input_ids, attention_mask)
    assert out.batch_decoder_calls > 1 and seen.made
    assert not sizes & set(seen.made)


# ---- 6. checkpoints, options, config ------------------------------------------------------------

def test_a_checkpoint_with_one_pair_of_layers_per_head_loads_as_the_stacked_heads():
    """A state dict that stores each head's layers apart (`heads.{i}.w1.weight` (d_ff, d_model),
    `heads.{i}.w2.weight` (d_model, d_ff)) loads into the stacked weights, and the decoder
    proposes and decodes exactly as the one it was taken from."""
    model = tiny_t5(0)
    trained = randomise_heads(blockwise(model, block_size=4, max_new_tokens=20), 3)
    with torch.no_grad():
        trained.heads.w1.copy_(torch.randn(trained.heads.w1.shape, generator=torch.Generator().manual_seed(4)))
    d_ff, heads = model.config.d_ff, trained.heads
    separate = {**{f"heads.{i}.w1.weight": heads.w1[i * d_ff: (i + 1) * d_ff].clone() for i in range(3)},
                **{f"heads.{i}.w2.weight": heads.w2[i].clone() for i in range(3)}}
    loaded = blockwise(model, block_size=4, max_new_tokens=20)
    loaded.load_state_dict(separate)
    assert torch.equal(loaded.heads.w1, heads.w1) and torch.equal(loaded.heads.w2, heads.w2)
    input_ids, attention_mask = random_batch(4, seed=6)
    with torch.no_grad():
        assert loaded.generate(model, input_ids, attention_mask) == trained.generate(
            model, input_ids, attention_mask)


def test_sequential_can_decode_a_blockwise_checkpoint():
    seq, bw = decoder_class("sequential"), decoder_class("blockwise")
    assert seq.can_decode_checkpoint_of(bw) and bw.can_decode_checkpoint_of(seq)

    class PipelinedLike(Decoder):  # another layout family, like the pipelined decoder
        layout_family = "pipelined"
    assert not bw.can_decode_checkpoint_of(PipelinedLike)
    assert not PipelinedLike.can_decode_checkpoint_of(bw)
    for name in available():
        other = decoder_class(name)
        assert bw.can_decode_checkpoint_of(other) == (other.layout_family == "flat-causal")


@pytest.mark.parametrize("option,value", [("block_size", 1), ("top_k", 0), ("max_new_tokens", 0)])
def test_invalid_options_name_the_value(option, value):
    with pytest.raises(ValueError, match=rf"decoder\.{option} must be an integer >= .*got {value}"):
        blockwise(tiny_t5(0), **{option: value})


def test_yaml_options_are_the_constructor_arguments():
    from tasks.config import compose
    cfg = compose(task="keyphrase", decoder="blockwise")
    options = {k: v for k, v in cfg.decoder.items() if k != "name"}
    assert options == {"block_size": 4, "freeze_backbone": False, "top_k": 1,
                       "max_new_tokens": cfg.data.max_target_length, "draft_length": "fixed",
                       "min_acceptance": None, "compile": False}
    decoder = build_decoder("blockwise", tiny_t5(0).config, SPECIAL, **options)
    assert decoder.block_size == 4 and len(decoder.heads) == 3


def test_generation_only_options():
    assert set(decoder_class("blockwise").decode_only_options()) == {"top_k", "max_new_tokens",
                                                                      "draft_length", "min_acceptance", "compile"}
