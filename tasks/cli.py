"""What every command's entry point shares: its argument parser, its guard that turns user errors
into one clear line, its logger, and its report files. Runs themselves (training, checkpoints,
tracking) are in `tasks.runs`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_only

from datamodules.schema import DataError
from datamodules.tokenizer import TokenizerError
from tasks.config import ConfigError
from tasks.models import ModelError

log = logging.getLogger("tasks")

# Errors that mean "the input is wrong": printed as one clear line, without a traceback.
USER_ERRORS = (ConfigError, DataError, TokenizerError, ModelError)


def command_line(module: str, argv: list[str] | None) -> str:
    """The command a result was made by: `python -m MODULE` and its arguments, each quoted where
    a shell would read it otherwise (`"aggressive(redraft=outgrown)=S"`), so it runs as written."""
    return " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


# Names the commit of a copy of the source made without its git history (copied to a machine that
# has no git, say), for the results made there (`source_commit`).
COMMIT_VARIABLE = "PIPEDEC_COMMIT"


def source_commit(root: Path = Path(__file__).resolve().parents[1]) -> str | None:
    """The commit of the library's source (at `root`) that a result was made with: git's HEAD,
    marked "+changes" where tracked files differ from it; for a copy of the source without its
    git history, the environment's PIPEDEC_COMMIT; None where neither says."""
    root = root.resolve()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:   # the checkout's own history only, not that of a repository the copy lies inside
        if Path(git("rev-parse", "--show-toplevel")).resolve() == root:
            changed = git("status", "--porcelain", "--untracked-files=no")
            return git("rev-parse", "HEAD") + ("+changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return os.environ.get(COMMIT_VARIABLE) or None


def write_report(out: str | Path, result: dict, table: str) -> Path:
    """A command's result as FILE.json and its markdown table beside it as FILE.md."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table)
    return out


def show_report(out: str | Path | None, result, table: str) -> None:
    """A small command's ending: its table printed, and with `--out FILE.json` the result written
    as FILE.json + FILE.md (`write_report`)."""
    print(table)
    if out:
        out = write_report(out, result, table)
        print(f"wrote {out} and {out.with_suffix('.md')}")


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.max_epochs=3 "
                                                     "model=t5-small decoder.delay=2")
    parser.add_argument("--config", help="a YAML file merged after the config groups")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration and exit")
    return parser


# `--resume` given without an id: the latest unfinished run (fit) or comparison (compare)
LATEST = object()


def add_resume_argument(parser: argparse.ArgumentParser, metavar: str, help: str) -> None:
    parser.add_argument("--resume", nargs="?", const=LATEST, metavar=metavar, help=help)


def parse_with_resume(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, key=value overrides anywhere among them; `--resume key=value` is
    `--resume` (the latest) and that override, since ids never hold '='."""
    args = parser.parse_intermixed_args(argv)
    if isinstance(args.resume, str) and "=" in args.resume:
        args.overrides.append(args.resume)
        args.resume = LATEST
    return args


def main_guard(main) -> None:
    """Run an entry point; user errors become one clear line on stderr and exit code 2, Ctrl-C
    the line "interrupted" and exit code 130 (the shell's), without a traceback."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if rank_zero_only.rank != 0:  # other DDP processes would repeat rank 0's (whole-split) lines
        logging.getLogger().setLevel(logging.ERROR)
    torch.set_float32_matmul_precision("high")
    try:
        main()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: what was interrupted has said so (its runs are KILLED)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader of our output (`| head`) closed it: nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(1)
