"""The commands in README.md and docs/*.md stay true: every titanlab command parses against the
real options, and the blocks marked `<!-- doc-test: run ... -->` run on CPU in seconds
(`doc_commands` says what is checked and how; docs/contributing.md how to mark a block)."""

from __future__ import annotations

import os
import re

import doc_commands as dc
import pytest

COMMANDS = [c for page in dc.pages() for c in dc.extract(page)]
RUNNABLE = [c for c in COMMANDS if c.run is not None]
# One command may take this long on 2 shared cores; together they stay well under a minute.
SECONDS_PER_COMMAND = 60


def test_the_pages_have_commands_and_some_run():
    pages = {c.path for c in COMMANDS}
    assert {"README.md", "docs/getting_started.md", "docs/parallelism.md"} <= pages
    assert len(COMMANDS) > 80
    assert {c.path for c in RUNNABLE} >= {"README.md", "docs/getting_started.md"}


def test_every_documented_command_parses():
    problems = [p for c in COMMANDS for p in dc.check(c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", RUNNABLE, ids=[f"{c.path}:{c.line}" for c in RUNNABLE])
def test_runnable_command_runs_on_cpu(command, tmp_path):
    code, output, seconds = dc.run(command, str(tmp_path), timeout=2 * SECONDS_PER_COMMAND)
    assert code == 0, f"{command.path}:{command.line}: `{command.text}` exited {code}:\n{output}"
    assert seconds < SECONDS_PER_COMMAND, f"{command.text} took {seconds:.0f} s: too slow to run"


# --- the checker finds a broken command -----------------------------------------------------


def _mutated(page: str, old: str, new: str) -> list[str]:
    """The checker's problems for `page` with its first `old` changed to `new`."""
    with open(os.path.join(dc.REPO, page), encoding="utf-8") as f:
        text = f.read()
    assert old in text, f"{page} no longer has {old!r}: pick another mutation"
    assert not [p for c in dc.extract(page, text) for p in dc.check(c)]
    return [p for c in dc.extract(page, text.replace(old, new, 1)) for p in dc.check(c)]


@pytest.mark.parametrize(
    ("page", "old", "new", "reported"),
    [
        # a documented trainer option renamed: the config parser has no such key
        ("docs/getting_started.md", "--training.steps 2", "--training.stepz 2", "training.stepz"),
        # ... in a command spread over continuation lines
        (
            "docs/parallelism.md",
            "--parallelism.context_parallel_degree 4",
            "--parallelism.cp 4",
            "parallelism.cp",
        ),
        # a value of the wrong type
        ("docs/getting_started.md", "--training.steps 2", "--training.steps two", "must be an int"),
        # a tool's own flag, through its argparse parser
        ("docs/generation.md", "--max-new-tokens", "--max-new-tokenz", "--max-new-tokenz"),
        (
            "docs/checkpoints.md",
            "to-hf outputs/debug_model",
            "to-hff outputs/debug_model",
            "to-hff",
        ),
        # a titanlab subcommand that does not exist
        ("README.md", "titanlab convert to-hf", "titanlab convrt to-hf", "convrt"),
        # a shipped config that does not exist, and a Makefile target
        (
            "docs/getting_started.md",
            "train_configs/qwen3_debug.toml",
            "train_configs/qwen3_debugg.toml",
            "qwen3_debugg.toml",
        ),
        ("docs/contributing.md", "make docs ", "make doc ", "'doc'"),
        # the layout planner's trainer options (what its parser leaves over)
        (
            "docs/parallelism.md",
            "--training.global_batch_size 512",
            "--training.global_batch 512",
            "training.global_batch",
        ),
        # torchrun's own options
        ("docs/multinode.md", "--rdzv_backend c10d", "--rdzv_backnd c10d", "torchrun"),
    ],
)
def test_a_broken_command_is_reported(page, old, new, reported):
    problems = _mutated(page, old, new)
    assert problems, f"changing {old!r} to {new!r} in {page} went unnoticed"
    assert any(reported in p for p in problems), problems


def test_markers_placeholders_and_synopses():
    text = "\n".join(
        [
            "<!-- doc-test: skip -->",
            "```bash",
            "./run_train.sh --no.such option",
            "```",
            "<!-- doc-test: run --job.dump_folder {tmp} -->",
            "```bash",
            "./run_train.sh train_configs/debug_model.toml \\",
            "    --training.steps 2   # two steps",
            "```",
            "```",
            "./run_train.sh CONFIG [--section.key VALUE ...]",
            "python -m titanlab.generate CKPT --prompt-file prompts.txt --seed 1",
            "python -m titanlab.plan ... --explain ws64-fsdp8-tp8",
            "step: 1  loss: 8.3   # output, not a command: left alone",
            "```",
        ]
    )
    commands = dc.extract("page.md", text)
    assert [(c.line, c.run) for c in commands] == [
        (7, "--job.dump_folder {tmp}"),
        (11, None),
        (12, None),
        (13, None),
        (14, None),
    ]
    assert commands[0].text.endswith("--training.steps 2   # two steps")
    assert [p for c in commands for p in dc.check(c)] == []
    ran = dc.with_options(commands[0], "/tmp/x")
    assert ran.endswith("--training.steps 2 --job.dump_folder /tmp/x")


# --- README links ---------------------------------------------------------------------------


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of the Markdown headings of `path` (the site uses the same slugs)."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
        out.add(slug.replace(" ", "-"))
    return out


def test_readme_links_point_to_pages_and_headings_that_exist():
    with open(os.path.join(dc.REPO, "README.md"), encoding="utf-8") as f:
        links = re.findall(r"\]\(([^)\s]+)\)", f.read())
    local = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert len(local) > 20
    for link in local:
        target, _, anchor = link.partition("#")
        path = os.path.join(dc.REPO, target)
        assert os.path.exists(path), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"README links to {link}: no such heading"
