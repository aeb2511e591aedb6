"""The training configs shipped with titanlab, found by name from any directory.

A source checkout keeps them in `train_configs/`; a wheel carries the same files as the package
folder `titanlab/train_configs/` (setup.py maps the one onto the other at build time). So
`titanlab train debug_model.toml`, `titanlab train train_configs/llama_8b.toml` and
`--job.config_file qwen3_debug` work from any directory, installed or not: a path that exists
is used as it is, and only a path that does not is looked up here.
"""

from __future__ import annotations

import difflib
import os

from titanlab.config.errors import ConfigError

DEFAULT_CONFIG = "debug_model.toml"
# titanlab/ (this file is titanlab/config/shipped.py)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_root() -> str | None:
    """The source checkout this package runs from (an editable install or `PYTHONPATH`), or None
    for an installed wheel: the folder above `titanlab/` when it holds `pyproject.toml` and
    `train_configs/`."""
    root = os.path.dirname(_PACKAGE)
    marks = (os.path.join(root, "pyproject.toml"), os.path.join(root, "train_configs"))
    return root if os.path.isfile(marks[0]) and os.path.isdir(marks[1]) else None


def shipped_config_dir() -> str | None:
    """The folder of the shipped configs: `titanlab/train_configs` in an installed wheel, else
    the checkout's `train_configs/`; None when neither exists."""
    installed = os.path.join(_PACKAGE, "train_configs")
    if os.path.isdir(installed):
        return installed
    root = checkout_root()
    return os.path.join(root, "train_configs") if root else None


def shipped_configs() -> list[str]:
    """Sorted file names (`debug_model.toml`, ...) of the shipped configs; [] when none."""
    folder = shipped_config_dir()
    if folder is None:
        return []
    return sorted(n for n in os.listdir(folder) if n.endswith(".toml"))


def resolve_config_file(path: str) -> str:
    """The config file `path` names: `path` itself when it is a file, else the shipped config of
    that name (`debug_model.toml`, `debug_model` or `train_configs/debug_model.toml`).

    Args:
        path: a file path, or the name of a shipped config, optionally under `train_configs/`.

    Returns:
        `path` unchanged when it exists, else the absolute path of the shipped config.

    Raises:
        ConfigError: neither exists; the line lists the shipped configs and the closest name.
    """
    if os.path.isfile(path):
        return path
    name = os.path.basename(path)
    name = name if name.endswith(".toml") else f"{name}.toml"
    known = shipped_configs()
    folder = shipped_config_dir()
    if os.path.dirname(os.path.normpath(path)) in ("", "train_configs") and name in known:
        assert folder is not None  # known is empty without it
        return os.path.join(folder, name)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(known) if known else "none found"
    raise ConfigError(f"config file {path!r} does not exist{hint} (shipped configs: {listed})")


def resolve_config_option(argv: list[str]) -> list[str]:
    """`argv` with the value of `--job.config_file F` (or `--job.config_file=F`) resolved by
    `resolve_config_file`; other arguments are kept as they are.

    Raises:
        ConfigError: as `resolve_config_file`.
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--job.config_file" and i + 1 < len(out):
            out[i + 1] = resolve_config_file(out[i + 1])
        elif arg.startswith("--job.config_file="):
            out[i] = "--job.config_file=" + resolve_config_file(arg.split("=", 1)[1])
    return out


# `python SCRIPT ARGS` with sys.argv[0] = PROG (runpy.run_path would set it to the script's path)
_AS_SCRIPT = (
    "import __main__, os, sys; script, prog = sys.argv[1:3]; sys.argv = [prog, *sys.argv[3:]]; "
    "sys.path.insert(0, os.path.dirname(script)); __main__.__file__ = script; "
    "exec(compile(open(script, encoding='utf-8').read(), script, 'exec'), __main__.__dict__)"
)


def run_checkout_script(script: str, prog: str, argv: list[str]) -> int:
    """Run the checkout's `script` (e.g. tools/benchmark.py) with `argv` in a Python process of
    its own, as `python SCRIPT ARGV` runs it but named `prog` (`titanlab bench`) in its argparse
    usage and error lines; returns its exit code."""
    import subprocess
    import sys

    return subprocess.call([sys.executable, "-c", _AS_SCRIPT, script, prog, *argv])
