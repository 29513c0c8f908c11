"""`python -m tasks` lists every command under its group with what it does, without importing any
command; a listed command's --help works."""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADINGS = ["train and evaluate", "experiments", "benchmarks"]
# A listed command: two spaces, the command line, two or more spaces, what it does.
COMMAND = re.compile(r"^  (python -m tasks\.[\w.]+|tasks/\S+)\s{2,}(.*)$")


def run_listing(*python_args: str) -> str:
    done = subprocess.run([sys.executable, *python_args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def listing() -> str:
    return run_listing("-m", "tasks")


@pytest.fixture(scope="module")
def groups(listing) -> dict[str, dict[str, str]]:
    """Per heading, its commands and what each does, as listed."""
    grouped: dict[str, dict[str, str]] = {}
    current = None
    for line in listing.splitlines():
        if line in HEADINGS:
            current = grouped.setdefault(line, {})
        elif (match := COMMAND.match(line)) is not None:
            assert current is not None, f"a command before any heading: {line!r}"
            current[match[1]] = match[2].strip()
    return grouped


def modules(folder: str) -> list[str]:
    return sorted(f"python -m tasks.{folder}.{path.stem}"
                  for path in (ROOT / "tasks" / folder).glob("*.py") if path.stem != "__init__")


def test_the_groups_are_listed_in_order(listing, groups):
    lines = listing.splitlines()
    assert [line for line in lines if line in HEADINGS] == HEADINGS
    assert list(groups) == HEADINGS


def test_every_command_is_listed_under_its_group_with_what_it_does(groups):
    expected = {
        "train and evaluate": ["python -m tasks.fit", "python -m tasks.test", "python -m tasks.compare",
                               "python -m tasks.predict", "python -m tasks.export"],
        "experiments": modules("experiments"),
        "benchmarks": modules("bench") + ["tasks/bench/run_benchmarks.sh",
                                          "tasks/bench/run_gpu_benchmarks.sh"],
    }
    for heading, commands in expected.items():
        assert sorted(groups[heading]) == sorted(commands), heading
        for command in commands:
            assert groups[heading][command], f"{command} is listed without what it does"


def test_listing_imports_no_command():
    """The summaries come from the sources: no command (nor torch) is imported to list them, so
    that the listing is fast and never runs a script that works at import."""
    imported = run_listing("-c", "import runpy, sys; runpy.run_module('tasks', run_name='__main__'); "
                                 "print(' '.join(sorted(sys.modules)))").splitlines()[-1].split()
    assert [name for name in imported if name.startswith("tasks.")] == []
    assert "torch" not in imported


@pytest.mark.parametrize("module", ["tasks.fit", "tasks.experiments.reference_calls"])
def test_a_listed_command_shows_its_help_with_what_it_does(module, groups, capsys):
    listed = {command: does for commands in groups.values() for command, does in commands.items()}
    does = listed[f"python -m {module}"]
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage:")
    assert " ".join(does.split()) in " ".join(shown.split())  # argparse rewraps the description


def test_a_reader_that_stops_early_gets_no_traceback():
    """`python -m tasks.fit --print-config | head -1`: a closed pipe ends the command quietly. The
    pipe here is closed before the command starts, so its first write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "tasks.fit", "--task", "keyphrase",
                               "--print-config"], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert b"Traceback" not in done.stderr, done.stderr.decode()[-500:]
