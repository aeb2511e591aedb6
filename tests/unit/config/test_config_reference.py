"""The config reference (docs/configuration.md) is generated from the dataclasses and must be
current; the README names the commands a newcomer came for."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_config_reference_is_current():
    proc = subprocess.run(
        [sys.executable, "tools/gen_config_docs.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_names_the_commands():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for command in ("make train", "make test", "./run_train.sh", "titanlab "):
        assert command in text, command
