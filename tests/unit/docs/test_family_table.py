"""The model tables of README.md and docs/models.md equal the model registry: every family, each
with its flavors in the registry's order, and configs that exist and train that family; the
README's table also names every shipped config."""

from __future__ import annotations

import os
import re

import pytest

from titanlab.config.manager import load_toml
from titanlab.models.registry import DEFAULT_FAMILY, FAMILIES, get_family

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BEGIN, END = "<!-- families-table:begin", "<!-- families-table:end -->"


def table(page: str) -> list[dict[str, str]]:
    """The rows of the table between the families-table markers of `page`, by header."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    assert BEGIN in text and END in text, f"{page} lacks the families-table markers"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [line.strip() for line in block.splitlines() if line.strip().startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]  # cells[1] is the |---| line
    return [dict(zip(header, row)) for row in rows]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def family_rows(page: str) -> list[dict[str, str]]:
    rows = table(page)
    if "kind" in rows[0]:  # README: models and methods in one table
        rows = [r for r in rows if r["kind"] == "model"]
    return rows


def column(row: dict[str, str], word: str) -> str:
    (key,) = [k for k in row if word in k]
    return row[key]


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_family_table_equals_the_registry(page):
    rows = family_rows(page)
    in_table = {ticked(column(r, "name"))[0]: ticked(column(r, "flavors")) for r in rows}
    registry = {name: list(get_family(name).flavors) for name in FAMILIES}
    assert list(in_table) == list(registry), f"{page}: families differ from FAMILIES"
    for name, flavors in registry.items():
        assert in_table[name] == flavors, f"{page}: the flavors of {name} differ from the registry"
    (default,) = [ticked(column(r, "name"))[0] for r in rows if "(default)" in column(r, "name")]
    assert default == DEFAULT_FAMILY


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_each_listed_config_exists_and_trains_its_family(page):
    for row in family_rows(page):
        family = ticked(column(row, "name"))[0]
        configs = ticked(column(row, "configs"))
        assert configs, f"{page}: {family} lists no config"
        for name in configs:
            path = os.path.join(REPO, "train_configs", name)
            assert os.path.exists(path), f"{page}: train_configs/{name} does not exist"
            assert load_toml(path).get("model", {}).get("name", DEFAULT_FAMILY) == family, name


def test_readme_table_names_every_shipped_config_and_method_page():
    rows = table("README.md")
    named = {c for row in rows for c in ticked(row["configs"]) if c.endswith(".toml")}
    shipped = {f for f in os.listdir(os.path.join(REPO, "train_configs")) if f.endswith(".toml")}
    assert named == shipped, f"shipped but not in the README table: {sorted(shipped - named)}"
    methods = [r["name"] for r in rows if r["kind"] == "method"]
    assert methods == ["chat SFT", "LoRA", "QLoRA", "distillation", "GRPO", "PPO", "DPO"]
    assert all("](docs/" in r["docs"] for r in rows)
