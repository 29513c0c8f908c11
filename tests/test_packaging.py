"""The library installs as a package and runs from anywhere: a wheel built from the repository,
installed into a folder of its own, runs `tasks.fit` from another directory with its configuration
files (shipped with the package, not read from the clone)."""
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


PRIVATE_TRANSFORMERS_NAMES = ("._attn_implementation", "._shift_right", "._relative_position_bucket",
                              "DynamicLayer", ".self_attention_cache.layers")


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

