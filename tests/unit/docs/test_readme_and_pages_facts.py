"""What the README and the pages tell a new user matches what the checkout does (issue 64's
rough edges: the command after `make setup`, the CPU example's commands, the docs' search, the
data page on context parallel)."""

import os
import re

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
