"""tasks.experiments.teacher_forced: the model's argmax at each target token, tallied by the token's
place in the flat target."""
import pytest
import torch

from decoders.sequential import join_subsequences
from tasks.config import ConfigError, compose
from tasks.experiments import teacher_forced
from tasks.experiments.teacher_forced import Tally, place_of, tally, target_places
from tasks.runs.trainer import build
from tests.conftest import save_checkpoint
from tests.test_end_to_end import TINY, tracking

SEP, EOS = 1, 2


def test_places_follow_the_flat_layout():
    subsequences = [[5, 6], [7], [8, 9, 10]]
    assert target_places(subsequences) == [
        ("start", 1), ("inside", 1), ("separator", 1), ("start", 2), ("separator", 2),
        ("start", 3), ("inside", 3), ("inside", 3), ("end", 4)]
    assert len(target_places(subsequences)) == len(join_subsequences(subsequences, SEP, EOS))
    assert [place_of("start", k) for k in (1, 4, 5, 9)] == [
        "start of subsequence 1", "start of subsequence 4", "start of subsequence 5+",
        "start of subsequence 5+"]


def test_a_wrong_start_is_told_apart_by_whose_first_token_it_guesses():
    """Guesses built by hand at each token of [5 6] <sep> [7] <sep> [8] </s>: the first start guesses
    the third subsequence's first token (later), the second guesses the first's (earlier), the
    third one no first token at all; the first separator is missed."""
    subsequences = [[5, 6], [7], [8]]
    flat = join_subsequences(subsequences, SEP, EOS)             # 5 6 1 7 1 8 2
    guesses = [8, 6, 9, 5, SEP, 6, EOS]
    losses = [float(j) for j in range(len(flat))]
    tallies: dict[str, Tally] = {}
    tally(tallies, subsequences, guesses, losses, SEP, EOS)
    assert tallies["start of subsequence 1"] == Tally(tokens=1, right=0, loss=0.0, later_first=1)
    assert tallies["start of subsequence 2"] == Tally(tokens=1, right=0, loss=3.0, earlier_first=1)
    assert tallies["start of subsequence 3"] == Tally(tokens=1, right=0, loss=5.0)
    assert tallies["inside"] == Tally(tokens=1, right=1, loss=1.0)
    assert tallies["separator"] == Tally(tokens=2, right=1, loss=2.0 + 4.0)
    assert tallies["end"] == Tally(tokens=1, right=1, loss=6.0)

    # a second example adds to the same rows; a guess right at a start counts neither way
    tally(tallies, [[7]], [7, EOS], [0.5, 0.5], SEP, EOS)
    assert tallies["start of subsequence 1"] == Tally(tokens=2, right=1, loss=0.5, later_first=1)
    assert tallies["end"].tokens == 2


def test_every_target_token_is_tallied_once_with_the_models_own_loss(tmp_path):
    """On a saved (untrained) sequential checkpoint: the rows add up to the split's flat target
    tokens, and their summed loss is the sequential loss the model trains with."""
    built = build(compose("qa", "sequential", None, [*TINY, *tracking(tmp_path)]))
    path = save_checkpoint(built.module, tmp_path / "sequential.ckpt")
    result = teacher_forced.main(["--ckpt", path, "--split", "test", *tracking(tmp_path)])

    special, module = built.module.decoder.special, built.module.eval()
    targets = [example.target_ids for example in built.datamodule.dataset("test")]
    flat = [join_subsequences(target, special.sep, special.eos) for target in targets]
    assert sum(row["tokens"] for row in result["rows"]) == sum(map(len, flat))
    assert {row["place"] for row in result["rows"]} >= {"start of subsequence 1", "separator", "end"}
    total = 0.0
    with torch.no_grad():
        for batch in built.datamodule.ordered_loader("test"):
            total += module.batch_loss(batch).item() * sum(
                len(join_subsequences(t, special.sep, special.eos)) for t in batch["targets"])
    assert sum(row["loss"] for row in result["rows"]) == pytest.approx(total, rel=1e-6)  # float32 sums


def test_a_checkpoint_of_another_layout_is_refused(tmp_path):
    built = build(compose("qa", "pipelined", None, [*TINY, *tracking(tmp_path)]))
    path = save_checkpoint(built.module, tmp_path / "pipelined.ckpt")
    with pytest.raises(ConfigError, match="trained with decoder 'pipelined'; decoder 'sequential' "
                                          "cannot decode it"):
        teacher_forced.main(["--ckpt", path, *tracking(tmp_path)])
