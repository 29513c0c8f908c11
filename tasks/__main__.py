"""The library's commands, one line each with what it does: `python -m tasks`.

Each line is the first line of the command's docstring (of a shell script, its opening comment),
read from the source without importing it: importing a command loads torch and Lightning, and some
benchmarks run as they are imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

TASKS = Path(__file__).resolve().parent
# The commands that train and evaluate, in the order they are used; each one listed where it exists.
TRAIN_AND_EVALUATE = ("fit", "test", "compare", "predict", "export")


def summary(path: Path) -> str:
    """A Python module's docstring's first line, or a shell script's first comment line after
    the `#!` line; empty where there is none."""
    text = path.read_text()
    if path.suffix == ".py":
        lines = (ast.get_docstring(ast.parse(text)) or "").splitlines()
    else:
        lines = [line.lstrip("#").strip() for line in text.splitlines()
                 if line.startswith("#") and not line.startswith("#!")]
    return lines[0].strip() if lines else ""


def folder_commands(folder: str) -> list[tuple[str, Path]]:
    """The command line and source of each module of `tasks/<folder>`, then of each shell script."""
    modules = sorted(path for path in (TASKS / folder).glob("*.py") if path.stem != "__init__")
    scripts = sorted((TASKS / folder).glob("*.sh"))
    return ([(f"python -m tasks.{folder}.{path.stem}", path) for path in modules]
            + [(str(path.relative_to(TASKS.parent)), path) for path in scripts])


def command_groups() -> dict[str, list[tuple[str, Path]]]:
    return {
        "train and evaluate": [(f"python -m tasks.{name}", TASKS / f"{name}.py")
                               for name in TRAIN_AND_EVALUATE if (TASKS / f"{name}.py").is_file()],
        "experiments": folder_commands("experiments"),
        "benchmarks": folder_commands("bench"),
    }


def main() -> None:
    groups = command_groups()
    width = max(len(command) for commands in groups.values() for command, _ in commands)
    for heading, commands in groups.items():
        print(heading)
        for command, path in commands:
            print(f"  {command:<{width}}  {summary(path)}")
        print()
    print("A python command's options: python -m tasks.<command> --help")


if __name__ == "__main__":
    main()
