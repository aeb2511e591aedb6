"""The shell commands of README.md and docs/*.md, and a checker that they still parse.

A command is a line (with its `\\` continuations) of a fenced code block tagged bash, sh, shell,
console or nothing. Only the commands of this project are checked; `pip`, `hf`, `vllm`, output
lines and the like are left alone:

- `./run_train.sh [CONFIG] OPTIONS`, `titanlab train`, `python -m titanlab.train`, `torchrun` /
  `python -m torch.distributed.run ... -m MODULE`, `sbatch ... multinode_trainer.slurm OPTIONS`:
  the config file must exist (a path under train_configs/ must; another name is a placeholder
  and the defaults stand in) and `titanlab.config.manager.build_config` must accept the options:
  every `--section.key` exists, its value has the field's type, the sections validate.
- `python -m titanlab.preflight` and `tools/estimate_memory.py`: `--nproc` / `--nnodes`, then the
  same.
- `titanlab SUBCOMMAND`: the subcommand is one of `titanlab.cli.COMMANDS`; its arguments go to
  that command's parser.
- Any other `python -m titanlab.X`, `python -m tools.X` or `python tools/X.py`: its own argparse
  parser must accept the arguments (the tool's `main` runs until it parses, then stops); what a
  parser leaves over (`parse_known_args`) must be trainer options.
- `make TARGET`: the target exists in the Makefile.

Placeholders: a bare `...` is dropped, a word in capitals (`CKPT`, `OUT`, `N`) stands for a
value, and a `[...]` group of a synopsis is optional. A block preceded by
`<!-- doc-test: run [OPTIONS] -->` is also run (`run_block`); `<!-- doc-test: skip -->` skips
the block.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<what>run|skip)(?P<options>[^>]*?)\s*-->\s*$")
SHELL_INFO = {"", "bash", "sh", "shell", "console"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # CKPT, OUT, N, RUN_DIR
PYTHONS = {"python", "python3", ".venv/bin/python"}
DEFAULT_SLURM_CONFIG = "train_configs/llama_8b.toml"


@dataclass(frozen=True)
class Command:
    """One command of a page: where it is, its text (continuations joined) and, for a block
    marked `doc-test: run`, the options to append to its training commands (else None)."""

    path: str
    line: int
    text: str
    run: str | None = None


def extract(path: str, text: str | None = None) -> list[Command]:
    """Every command line of the fenced shell blocks of the Markdown file `path` (or of
    `text`, read as that file)."""
    if text is None:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read()
    commands = []
    for m in FENCE.finditer(text):
        if m.group("info").strip().split(" ")[0] not in SHELL_INFO:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        if marker and marker.group("what") == "skip":
            continue
        run = marker.group("options").strip() if marker else None
        first = text.count("\n", 0, m.start()) + 2  # the block's first line, 1-based
        lines = m.group("body").splitlines()
        i = 0
        while i < len(lines):
            start, line = i, lines[i].strip()
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if line and not line.startswith("#"):
                commands.append(Command(path, first + start, line, run))
    return commands


def words(text: str) -> list[str]:
    """The words of a command: comments, bare `...` and optional `[...]` groups dropped."""
    text = re.sub(r"(?<!\S)\.\.\.(?!\S)", " ", text)
    text = re.sub(r"(?<!\S)\[[^\]]*\](?!\S)", " ", text)
    return shlex.split(text, comments=True)


def _value(word: str) -> str:
    return "1" if PLACEHOLDER.match(word) else word


def _either(check_one, argv: list[str]) -> list[str]:
    """`check_one`'s problems with the words as written, unless a placeholder in capitals
    (`CKPT`, `N`) read as a value ("1") makes them parse."""
    problems = check_one(argv)
    if problems and any(PLACEHOLDER.match(w) for w in argv):
        if not check_one([_value(w) for w in argv]):
            return []
    return problems


def _absolute_config_files(argv: list[str]) -> list[str]:
    """`--job.config_file PATH` made absolute when PATH is the repository's."""
    out = list(argv)
    for i, w in enumerate(out):
        if w == "--job.config_file" and i + 1 < len(out):
            if os.path.exists(os.path.join(REPO, out[i + 1])):
                out[i + 1] = os.path.join(REPO, out[i + 1])
        elif w.startswith("--job.config_file="):
            value = w.split("=", 1)[1]
            if os.path.exists(os.path.join(REPO, value)):
                out[i] = "--job.config_file=" + os.path.join(REPO, value)
    return out


class _Parsed(Exception):
    """Raised by the patched argparse once the tool's top-level parser has parsed."""

    def __init__(self, extras: list[str]):
        self.extras = extras


@contextlib.contextmanager
def _stop_after_parsing():
    """Patch argparse so that the first (outermost) parse runs and then raises `_Parsed`, so a
    tool's `main` never gets past its parser."""
    real_args, real_known = (
        argparse.ArgumentParser.parse_args,
        argparse.ArgumentParser.parse_known_args,
    )
    depth = [0]

    def wrap(real, known):
        def parse(self, args=None, namespace=None):
            depth[0] += 1
            try:
                result = real(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0]:
                return result
            raise _Parsed(list(result[1]) if known else [])

        return parse

    argparse.ArgumentParser.parse_args = wrap(real_args, False)  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = wrap(real_known, True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real_args  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_known_args = real_known  # type: ignore[method-assign]


def check_trainer(config: str, options: list[str]) -> list[str]:
    """Problems of a training command's config file and `--section.key` options."""
    from titanlab.config.job_config import ConfigError
    from titanlab.config.manager import build_config

    head: list[str] = []
    if config:
        shipped = os.path.join(REPO, "train_configs", config)  # a shipped config by its name
        path = os.path.join(REPO, config)
        if os.path.exists(path) or os.path.exists(shipped):
            head = ["--job.config_file", path if os.path.exists(path) else shipped]
        elif config.startswith("train_configs/") or (config.endswith(".toml") and "/" in config):
            return [f"config file {config} does not exist"]

    def parse(argv: list[str]) -> list[str]:
        try:
            build_config(head + _absolute_config_files(argv))
        except ConfigError as e:
            return [f"trainer options: {e}"]
        return []

    return _either(parse, options)


def check_counts_then_trainer(argv: list[str], counts: tuple[str, ...]) -> list[str]:
    """`--nproc N` / `--nnodes M` (in any order, first), then trainer options."""
    while argv[:1] and argv[0] in counts:
        if len(argv) < 2 or not _value(argv[1]).isdigit():  # --nproc N: a placeholder is fine
            return [f"{argv[0]} needs a whole number"]
        argv = argv[2:]
    return check_trainer("", argv)


def check_argparse(module: str, argv: list[str], prog: str) -> list[str]:
    """Problems of `argv` for the tool `module`, found by its own argparse parser."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return [f"cannot import {module}: {e}"]
    main = getattr(mod, "main", None)
    home = inspect.getmodule(main) if main is not None else None
    source = inspect.getsource(home) if home is not None else ""
    if not any(name in source for name in ("parse_args", "parse_known_args", "build_parser")):
        return []  # no argparse parser to ask: only the module's existence is checked
    return _either(lambda words: _parse_with(main, words, prog), argv)


def _parse_with(main, argv: list[str], prog: str) -> list[str]:
    """Call the tool's `main(argv)` until its parser has parsed `argv`."""
    params = inspect.signature(main).parameters
    err, saved_argv = io.StringIO(), sys.argv
    sys.argv = [prog, *argv]
    try:
        with (
            _stop_after_parsing(),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            if "prog" in params:
                main(argv, prog=prog)
            elif params:
                main(argv)
            else:
                main()
    except _Parsed as parsed:
        return check_trainer("", parsed.extras) if parsed.extras else []
    except SystemExit as e:
        if e.code in (0, None):
            return []  # --help
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return [f"{prog}: {lines[-1] if lines else f'exit {e.code}'}"]
    finally:
        sys.argv = saved_argv
    return [f"{prog} ran without parsing its arguments with argparse"]


def check_module(module: str, argv: list[str]) -> list[str]:
    """Problems of `python -m module argv`."""
    if module == "titanlab.train":
        return [] if {"--help", "-h"} & set(argv) else check_trainer("", argv)
    if module == "titanlab.preflight":
        return check_counts_then_trainer(argv, ("--nproc", "--nnodes"))
    if module == "torch.distributed.run":
        return check_launcher(argv)
    if module.startswith(("titanlab.", "tools.")):
        if importlib.util.find_spec(module) is None:
            return [f"no module {module}"]
        if module == "tools.estimate_memory":
            return check_counts_then_trainer(argv, ("--nproc",))
        return check_argparse(module, argv, f"python -m {module}")
    return []


def check_launcher(argv: list[str]) -> list[str]:
    """torchrun's own options (its parser, `torch.distributed.run.get_args_parser`), then the
    module (`-m MODULE ARGS`) or script it starts."""
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = get_args_parser().parse_args([_value(w) for w in argv])
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return [f"torchrun: {lines[-1] if lines else 'bad arguments'}"]
    script, rest = args.training_script, list(args.training_script_args)
    return check_module(script, rest) if args.module else check_python([script, *rest])


def check_python(argv: list[str]) -> list[str]:
    """`python ARGV`: `-m MODULE ...` or `SCRIPT.py ...`."""
    if argv[:1] == ["-m"] and len(argv) > 1:
        return check_module(argv[1], argv[2:])
    if argv and argv[0].endswith(".py"):
        script = argv[0]
        if not os.path.exists(os.path.join(REPO, script)):
            return [f"no script {script}"]
        if script.startswith("tools/") and script.count("/") == 1:
            return check_module("tools." + script[len("tools/") : -3], argv[1:])
    return []


def check_titanlab(argv: list[str]) -> list[str]:
    """`titanlab SUBCOMMAND ARGS`, against the console script's own command table."""
    from titanlab.cli import COMMANDS

    if not argv or argv[0] in ("--version", "--help", "-h") or PLACEHOLDER.match(argv[0]):
        return []
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        return [f"titanlab has no subcommand {name!r} (it has {', '.join(COMMANDS)})"]
    if name == "train":
        config = rest[0] if rest and not rest[0].startswith("--") else ""
        return check_trainer(
            config or "train_configs/debug_model.toml", rest[1:] if config else rest
        )
    if name == "preflight":
        return check_counts_then_trainer(rest, ("--nproc", "--nnodes"))
    if name == "bench":
        return check_module("tools.benchmark", rest)
    module = COMMANDS[name][0].partition(":")[0]
    return check_argparse(module, rest, f"titanlab {name}")


def makefile_targets() -> set[str]:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", f.read(), re.M))


def split_env(ws: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=value` words (and `sudo`) as the environment, then the program's words."""
    env: dict[str, str] = {}
    while ws and (re.match(r"^[A-Za-z_]\w*=", ws[0]) or ws[0] == "sudo"):
        if ws[0] != "sudo":
            key, _, value = ws[0].partition("=")
            env[key] = value
        ws = ws[1:]
    return env, ws


def check_words(ws: list[str]) -> list[str]:
    """Problems of one simple command (no `&&`)."""
    env, ws = split_env(ws)
    if not ws:
        return []
    program, argv = ws[0], ws[1:]
    if program in ("./run_train.sh", "run_train.sh"):
        config = argv[0] if argv and not argv[0].startswith("--") else ""
        return check_trainer(
            config or "train_configs/debug_model.toml", argv[1:] if config else argv
        )
    if program == "titanlab":
        return check_titanlab(argv)
    if program in PYTHONS:
        return check_python(argv)
    if program == "torchrun":
        return check_launcher(argv)
    if program == "sbatch":
        if "multinode_trainer.slurm" not in argv:
            return []
        rest = argv[argv.index("multinode_trainer.slurm") + 1 :]
        return check_trainer(env.get("CONFIG_FILE", DEFAULT_SLURM_CONFIG), rest)
    if program == "make":
        targets = [w for w in argv if "=" not in w and not w.startswith("-")]
        missing = sorted(set(targets) - makefile_targets())
        return [f"the Makefile has no target {t!r}" for t in missing]
    return []


def check(command: Command) -> list[str]:
    """Problems of `command`, each as `path:line: problem` ([] when it parses)."""
    try:
        ws = words(command.text)
    except ValueError as e:
        return [f"{command.path}:{command.line}: cannot split {command.text!r}: {e}"]
    problems, part = [], []
    for w in [*ws, "&&"]:
        if w in ("&&", "||", ";"):
            problems += check_words(part)
            part = []
        else:
            part.append(w)
    return [f"{command.path}:{command.line}: {p} (in: {command.text})" for p in problems]


def with_options(command: Command, tmp: str) -> str:
    """The command as run: the marker's options appended to each training command."""
    options = (command.run or "").replace("{tmp}", tmp)
    if not options:
        return command.text
    ws = words(command.text)
    _, program = split_env(ws)
    trains = program[:1] in (["./run_train.sh"], ["run_train.sh"]) or program[:2] == [
        "titanlab",
        "train",
    ]
    return shlex.join(ws + shlex.split(options)) if trains else command.text


def run(command: Command, tmp: str, timeout: float = 120) -> tuple[int, str, float]:
    """Run `command` in the repository with bash on CPU: (exit code, output tail, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", with_options(command, tmp)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:], time.monotonic() - start


def pages() -> list[str]:
    """README.md and every Markdown page of docs/, as paths relative to the repository."""
    out = ["README.md"]
    for folder, _, files in sorted(os.walk(os.path.join(REPO, "docs"))):
        out += sorted(
            os.path.relpath(os.path.join(folder, f), REPO) for f in files if f.endswith(".md")
        )
    return out
