"""The wheel, as a user installs it: built with `python -m build --wheel` from the checkout's
files, installed into a fresh virtual environment (no system site-packages, no checkout on the
path), where `titanlab train` trains the debug model from a folder outside the checkout with the
config and tokenizer the wheel ships.

It installs with `tools/venv_install.sh`, as `make setup` does (uv where it can be had, else
pip). torch is pinned to the version this environment runs (2.13.0), found as pip finds it
through the machine's pip configuration (find-links); an unpinned torch would pull the CUDA
build. Elsewhere, `TORCH_CPU_PIP_ARGS` (as the Makefile's) adds installer arguments for it, e.g.
`--index-url https://download.pytorch.org/whl/cpu`.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomli
import zipfile

import pytest
import torch

from conftest import REPO

TORCH = torch.__version__.split("+")[0]
with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    VERSION = tomli.load(f)["project"]["version"]


def sh(cmd: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{shlex.join(cmd)}: {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"  # fmt: skip
    return proc


def source_copy(dest: str) -> str:
    """The checkout's files that git would commit (tracked or new, not ignored), copied to
    `dest`: no build/ leftovers or local outputs reach the wheel."""
    listed = sh(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60,
                cwd=REPO).stdout  # fmt: skip
    for rel in filter(None, listed.split("\0")):
        path = os.path.join(REPO, rel)
        if os.path.isfile(path):  # a file deleted in the work tree is still in the index
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(path, os.path.join(dest, rel))
    return dest


@pytest.mark.serial  # installs torch into a new environment: 1 GB written, both cores busy
def test_the_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    src = source_copy(str(tmp_path / "src"))
    sh([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), src], 300)
    (wheel,) = (tmp_path / "dist").glob("titanlab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        scripts = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "titanlab/data/assets/stdlib_bpe_4k.model" in names
    shipped = sorted(f"titanlab/train_configs/{n}" for n in os.listdir(f"{REPO}/train_configs"))
    assert [n for n in sorted(names) if n.startswith("titanlab/train_configs/")] == shipped
    assert "titanlab = titanlab.cli:main" in scripts
    assert not any(n.startswith(("tools/", "tests/")) for n in names)

    venv = tmp_path / "venv"
    sh([sys.executable, "-m", "venv", str(venv)], 120)
    python, titanlab = str(venv / "bin" / "python"), str(venv / "bin" / "titanlab")
    extra = shlex.split(os.environ.get("TORCH_CPU_PIP_ARGS", ""))
    # The installer `make setup` uses (uv where it can be had, else pip; TITANLAB_PIP=1: pip):
    # the wheel's metadata decides what it pulls in either way, and uv took 210 -> ~60 s of
    # this test off CI's 2 cores.
    install = [os.path.join(REPO, "tools", "venv_install.sh"), str(venv)]
    sh([*install, f"torch=={TORCH}", str(wheel), *extra], 600)

    run = tmp_path / "run"  # outside the checkout: no run_train.sh, train_configs/ or .venv
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NGPU="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    where = sh([python, "-c", "import titanlab; print(titanlab.__file__)"], 60, cwd=run, env=env)
    assert where.stdout.startswith(str(venv)), where.stdout
    assert sh([titanlab, "--version"], 60, cwd=run, env=env).stdout == f"titanlab {VERSION}\n"
    bench = subprocess.run([titanlab, "bench"], cwd=run, env=env, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert bench.returncode == 2 and len(bench.stderr.splitlines()) == 1
    assert "titanlab bench needs a source checkout (tools/benchmark.py)" in bench.stderr

    cmd = [titanlab, "train", "--model.flavor", "debugmodel", "--training.steps", "2",
           "--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "120"]  # fmt: skip
    proc = sh(cmd, 300, cwd=run, env=env)
    out = proc.stdout + proc.stderr
    config = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    config = config / "site-packages" / "titanlab" / "train_configs" / "debug_model.toml"
    assert f"config: {config};" in out  # the shipped config, from the installed package
    loss = re.search(r"step: 2\s+loss: (\S+)", out)
    assert loss and math.isfinite(float(loss.group(1))), out[-3000:]
    assert "training: done at step 2" in out
    assert (run / "outputs" / "debug_model" / "checkpoint" / "step-2").is_dir()
