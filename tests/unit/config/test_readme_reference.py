"""The README's config reference is generated from the dataclasses and must be current."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_readme_config_reference_is_current():
    proc = subprocess.run(
        [sys.executable, "tools/gen_config_docs.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_names_the_two_commands():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "make train" in text and "make test" in text
