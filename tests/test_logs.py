"""What the commands print: each thing once. Lightning's advertisement, the device lines every
trainer repeats (each entry point builds one to check the settings before the one that runs) and
third-party deprecation warnings stay out of a command's output."""
import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tasks.runs.trainer import ADVERTISEMENT, SAID_ONCE, LightningNotices, quiet_lightning
from tests.test_end_to_end import TINY, tracking

ROOT = Path(__file__).resolve().parents[1]
# what Lightning and torch printed into every command's output before they were filtered
UNWANTED = ["litlogger", "Tip:", "LeafSpec", "DeprecationWarning", "FutureWarning", "deprecated"]


def command_output(*args: str) -> str:
    """`python -m ARGS`'s standard output and standard error together, as a reader sees them."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


@pytest.mark.slow
def test_fit_test_and_predict_say_each_thing_once(tmp_path):
    outputs = {"fit": command_output("tasks.fit", "--task", "keyphrase", *TINY, *tracking(tmp_path))}
    checkpoint = str(next(tmp_path.glob("artifacts/*/checkpoints/epoch*.ckpt")))
    outputs["test"] = command_output("tasks.test", "--ckpt", checkpoint, *tracking(tmp_path),
                                     "trainer.enable_progress_bar=false")
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text(json.dumps({"title": "a title", "abstract": "an abstract"}) + "\n")
    outputs["predict"] = command_output("tasks.predict", "--ckpt", checkpoint, "--input", str(inputs))
    for command, output in outputs.items():
        for unwanted in UNWANTED:
            assert unwanted.lower() not in output.lower(), f"{command} printed {unwanted!r}:\n{output}"
        for line in ("GPU available: ", "TPU available: "):
            assert output.count(line) == 1, f"{command} said {line!r} {output.count(line)} times:\n{output}"


class Heard(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_lightning_lines_every_trainer_repeats_are_said_once():
    """CUDA's device line, which Lightning prints at each fit and each test (a fit tests too), said
    once per process; another rank's is said; the advertisement never. (A device that no other test
    names, as the lines are said once per process.)"""
    quiet_lightning()
    quiet_lightning()
    for name in SAID_ONCE:  # a second call adds no second filter
        assert sum(isinstance(f, LightningNotices) for f in logging.getLogger(name).filters) == 1
    heard = Heard()
    cuda = logging.getLogger("lightning.pytorch.accelerators.cuda")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    devices = uuid.uuid4().hex
    for logger in (cuda, rank_zero):
        logger.addHandler(heard)
    try:
        for rank in (0, 0, 1, 0):
            cuda.info(f"LOCAL_RANK: {rank} - CUDA_VISIBLE_DEVICES: [{devices}]")
        rank_zero.info(f"{ADVERTISEMENT}, try installing [litlogger]")
        rank_zero.info(f"GPU available: True ({devices}), used: True")
        rank_zero.info(f"GPU available: True ({devices}), used: True")
        rank_zero.info(f"an ordinary line {devices}")
        rank_zero.info(f"an ordinary line {devices}")
    finally:
        for logger in (cuda, rank_zero):
            logger.removeHandler(heard)
    assert heard.lines == [f"LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [{devices}]",
                           f"LOCAL_RANK: 1 - CUDA_VISIBLE_DEVICES: [{devices}]",
                           f"GPU available: True ({devices}), used: True",
                           f"an ordinary line {devices}", f"an ordinary line {devices}"]
