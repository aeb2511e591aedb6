"""What the README and the pages tell a new user matches what the checkout does (issue 64's
rough edges: the command after `make setup`, the CPU example's commands, the docs' search, the
data page on context parallel)."""

import contextlib
import io
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def test_the_readme_says_how_titanlab_becomes_a_command_before_using_it():
    readme = read("README.md")
    setup, first_use = readme.index("make setup"), readme.index("titanlab --version")
    assert setup < readme.index("source .venv/bin/activate") < first_use


def test_the_readme_uses_installed_commands_not_checkout_scripts():
    readme = read("README.md")
    assert "python -m tools.convert_checkpoint" not in readme
    assert "titanlab convert to-hf outputs/debug_model" in readme


def test_the_docs_search_is_served_by_a_make_target_the_readme_names():
    assert "make docs-serve" in read("README.md")
    assert re.search(
        r"^docs-serve: docs\n\t.*http\.server --directory site", read("Makefile"), re.M
    )


def test_the_data_page_does_not_refuse_document_masks_under_context_parallel():
    section = read("docs/data.md").split("With `document_mask`")[1].split("## 5.")[0]
    assert "refused with one line under context" not in section
    assert "tests/integration/test_cp_documents.py" in section


def test_the_cli_page_lists_every_optional_extra():
    """docs/cli.md's table of extras has a row for each of pyproject.toml's (it lacked ft and fla)."""
    import tomli

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomli.load(f)["project"]["optional-dependencies"]
    table = read("docs/cli.md").split("## Optional extras")[1]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", table, re.M))
    assert rows == set(extras), (sorted(set(extras) - rows), sorted(rows - set(extras)))


def test_the_readme_says_what_the_debug_models_generation_shows():
    """The README's CPU example ends with `titanlab generate` of the 150-step debug model, whose
    text is repetitive (`def parse_args(1, 1, 1, ...`): the sentence after the block says so."""
    readme = read("README.md")
    block_end = readme.index("```", readme.index('--prompt "def parse_args("'))
    after = readme[block_end + 3 :].lstrip().split("\n\n")[0]
    assert "repetitive" in after and "150" in after and "not what a trained model" in after


def test_the_pages_8b_memory_figure_is_what_the_pre_flight_prints(monkeypatch):
    """getting_started.md and troubleshooting.md quote the pre-flight's refusal of llama_8b.toml
    on 2 CPU processes: the figure they show is the estimate it makes now."""
    import torch

    from titanlab import preflight
    from titanlab.planning import memory

    if torch.cuda.is_available():
        pytest.skip("the pages quote a CPU-only machine's line")
    monkeypatch.setattr(memory, "available_bytes_per_rank", lambda n: (2**30, "1 GiB"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = preflight.main(["--nproc", "2", "--job.config_file", "train_configs/llama_8b.toml",
                               "--training.steps", "1"])  # fmt: skip
    assert code == 2
    figure = re.search(r"needs about ([\d.]+) GiB per rank", err.getvalue()).group(1)
    for page in ("docs/getting_started.md", "docs/troubleshooting.md"):
        assert f"model.flavor=8B needs about {figure} GiB per rank" in read(page), page
