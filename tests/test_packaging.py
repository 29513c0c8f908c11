"""The library installs as a package and runs from anywhere: a wheel built from the repository,
installed into a folder of its own, runs `tasks.fit` from another directory with its configuration
files (shipped with the package, not read from the clone)."""
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_end_to_end import TINY, tracking

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_wheel_installs_and_fits_from_another_directory(tmp_path):
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the files git would commit, copied: no build folder or other leftover of the clone's own
    # installs can slip into the wheel
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
                    str(source)], check=True, cwd=tmp_path)
    wheel, = wheels.glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, cwd=tmp_path)
    # the installed copy, not the clone: the clone is neither the working directory nor on the path
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=600)
    where = run("-c", "import configs, tasks; print(tasks.__file__); print(configs.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split())
    assert (site / "configs" / "decoder" / "pipelined.yaml").is_file()
    assert (site / "tasks" / "bench" / "run_benchmarks.sh").is_file()

    fitted = run("-m", "tasks.fit", "--task", "keyphrase", "--decoder", "pipelined", *TINY,
                 *tracking(tmp_path))
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "checkpoint: " in fitted.stderr
    listed = run("-m", "tasks")
    assert listed.returncode == 0 and "python -m tasks.experiments.pretrain" in listed.stdout


PRIVATE_TRANSFORMERS_NAMES = ("._attn_implementation", "._relative_position_bucket")


def test_transformers_internals_are_used_behind_one_door():
    """Only decoders/transformers_internals.py touches transformers' private names; the test
    fails if any other library module (or test) reaches past it."""
    door = REPO / "decoders" / "transformers_internals.py"
    sources = [p for folder in ("decoders", "datamodules", "tasks", "tests")
               for p in (REPO / folder).rglob("*.py") if p not in (door, Path(__file__).resolve())]
    used = {str(p.relative_to(REPO)): name for p in sources for name in PRIVATE_TRANSFORMERS_NAMES
            if name in p.read_text()}
    assert used == {}
    assert all(name.split(".")[-1] in door.read_text() for name in PRIVATE_TRANSFORMERS_NAMES)



def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, by its dotted name (`from a import b` counts as `a` and `a.b`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_module_imports_a_command():
    """Commands use the library, never each other: no module of the library imports a command
    (those `python -m tasks` lists: fit, test, predict, compare, the experiments, the benchmarks)."""
    from tasks.__main__ import command_groups
    commands = {str(path.relative_to(REPO).with_suffix("")).replace("/", ".")
                for group in command_groups().values() for _, path in group if path.suffix == ".py"}
    assert {"tasks.fit", "tasks.test", "tasks.predict", "tasks.compare"} <= commands
    library = [p for folder in ("decoders", "datamodules", "tasks", "configs")
               for p in (REPO / folder).rglob("*.py")]
    importing = {str(p.relative_to(REPO)): sorted(imported_modules(p) & commands) for p in library}
    assert {path: names for path, names in importing.items() if names} == {}


def test_the_import_scan_sees_each_form_of_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import tasks.fit\nfrom tasks import test\nfrom tasks.compare import main\n")
    assert {"tasks.fit", "tasks.test", "tasks.compare"} <= imported_modules(module)


# The transformers versions the library supports: the lowest that pyproject allows, and the newest
# the suite has passed on (docs/testing.md: CI installs the newest release; the lowest is run before
# each release, with the command and result written there).
LOWEST_TRANSFORMERS = "5.15.0"
NEWEST_TESTED_TRANSFORMERS = "5.24.0"


def transformers_requirement() -> tuple[str, str]:
    """(lowest allowed, first excluded) of pyproject's transformers requirement."""
    requirement = next(line for line in (REPO / "pyproject.toml").read_text().splitlines()
                       if line.strip().startswith('"transformers'))
    lowest, excluded = re.match(r'\s*"transformers>=([\d.]+),<([\d.]+)"', requirement).groups()
    return lowest, excluded


def version_tuple(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version: "4.56" is (4, 56, 0)."""
    parts = [int(part) for part in re.findall(r"\d+", version)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_supported_transformers_versions_are_those_pyproject_allows():
    import transformers
    lowest, excluded = transformers_requirement()
    assert version_tuple(LOWEST_TRANSFORMERS) == version_tuple(lowest)
    assert version_tuple(lowest) <= version_tuple(NEWEST_TESTED_TRANSFORMERS) < version_tuple(excluded)
    assert version_tuple(lowest) <= version_tuple(transformers.__version__) < version_tuple(excluded)
    assert LOWEST_TRANSFORMERS in (REPO / "docs" / "testing.md").read_text()
    assert NEWEST_TESTED_TRANSFORMERS in (REPO / "docs" / "testing.md").read_text()
