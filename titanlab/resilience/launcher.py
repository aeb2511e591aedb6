"""Run torchrun so that a failing rank's one `titanlab: error:` line is the last thing shown.

    python -m titanlab.launcher [--preflight] [torchrun options] -m titanlab.train [trainer options]

`run_train.sh`, `titanlab train` and `multinode_trainer.slurm` start training through this
module. It runs `torch.distributed.run` with the same arguments (with `--preflight`, as
`run_train.sh` and `titanlab train` pass it: `titanlab.planning.agent`, torchrun's agent with
the pre-flight check run first in its process; the launcher's log is opened only once the
check passed, so that a refused config writes nothing) and:
- passes the ranks' output through (torchrun prefixes it with `[rankN]:` under `--tee`);
- keeps torchrun's own report of a failed child (its `ChildFailedError` traceback and the
  `failed (exitcode: N)` lines) out of the terminal, in `<job.dump_folder>/logs/launcher-*.log`;
- when a rank failed with a titanlab error, prints the path of that log, then the failing rank's
  `titanlab: error: ...` line as the last line on stderr, and exits with that rank's exit code
  (2 config, 3 diverged, 4 hang, 5 out of memory; 75 requeue is handled by `run_train.sh`
  and `titanlab train`, `titanlab.resilience.run_train`).
  Each rank writes its line and code to `$TITANLAB_ERROR_DIR/rank<N>` (see
  `write_error_file`), so the line is found even when `--local-ranks-filter` hides that
  rank's output.
Any other failure (a crash with a Python traceback from a rank) keeps the rank's traceback on
the terminal and ends with one line naming the exit code and the log.

SIGTERM or SIGUSR1 to the launcher is passed to torchrun as SIGTERM (preemption), unless
`TITANLAB_FORWARD_SIGNALS=0` (under srun, where the signal reaches torchrun directly).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ERROR_DIR_ENV = "TITANLAB_ERROR_DIR"
# What `titanlab.planning.agent` writes to stderr once the pre-flight check passed.
PREFLIGHT_PASSED = "titanlab-agent: pre-flight passed"
ERROR_PREFIX = "titanlab: error:"
# 0 where the signal already reaches torchrun itself (srun signals every process of a step).
FORWARD_SIGNALS_ENV = "TITANLAB_FORWARD_SIGNALS"
# EX_TEMPFAIL of sysexits.h: the run stopped for preemption after saving; requeue it. Here, not in
# `preemption` (which imports torch), so that the launching process never imports torch.
REQUEUE_EXIT_CODE = 75
# The file rank 0 writes (its last step) when it stopped for preemption after saving.
MARKER_ENV = "TITANLAB_PREEMPT_MARKER"
# torchrun's own logging lines (glog style: "E1123 01:39:39.761000 3993 path:line] message")
_TORCHRUN_LOG = re.compile(r"^[EWIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")


def write_error_file(line: str, exit_code: int) -> None:
    """Record this rank's final error line for the launcher (no-op outside it)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(folder, f"rank{rank}"), "w", encoding="utf-8") as f:
            f.write(f"{exit_code}\n{line}\n")
    except OSError:
        pass  # the launcher then reports the exit code alone


def read_error_files(folder: str) -> tuple[int, str] | None:
    """(exit code, line) of the lowest rank that wrote an error file, or None."""
    found = []
    for name in os.listdir(folder):
        if not name.startswith("rank") or not name[4:].isdigit():
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                code_text, line = f.read().split("\n", 1)
            found.append((int(name[4:]), int(code_text), line.strip()))
        except (OSError, ValueError):
            continue
    if not found:
        return None
    _, code, line = min(found)
    return code, line


def dump_folder(trainer_args: list[str]) -> str:
    """`job.dump_folder` of the trainer's options ('outputs' when the config cannot be read;
    the trainer reports a bad config itself)."""
    try:
        from titanlab.config.manager import build_config

        return build_config(trainer_args).job.dump_folder
    except Exception:
        return "outputs"


def log_path(folder: str, kind: str = "launcher") -> str:
    """A new log file `<folder>/logs/<kind>-<time>-<host>-<pid>.log` (created empty; in the
    temp dir when the dump folder cannot be written, else os.devnull)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{kind}-{stamp}-{socket.gethostname()}-{os.getpid()}.log"
    for base in (os.path.join(folder, "logs"), tempfile.gettempdir()):
        try:
            os.makedirs(base, exist_ok=True)
            path = os.path.join(base, name)
            open(path, "a", encoding="utf-8").close()
            return path
        except OSError:
            continue
    return os.devnull


def is_launcher_noise(line: str) -> bool:
    """Whether a stderr line is torchrun's own report rather than a rank's output."""
    if re.fullmatch(r"\[\d+\]:", line.strip()):  # the failure table's "[0]:" entries
        return True
    return not line.startswith("[") and (
        bool(_TORCHRUN_LOG.match(line))
        or line.startswith(
            ("Traceback (most recent call last)", "  File ", "    ", "torch.distributed")
        )
        or line.startswith(
            (
                "=====",
                "-----",
                "Failures:",
                "Root Cause",
                "[0]:",
                "  time ",
                "  host ",
                "  rank ",
                "  exitcode ",
                "  error_file",
                "  traceback ",
            )
        )
        or "ChildFailedError" in line
        or line.rstrip().endswith("FAILED")
        or line.strip() in ("<NO_OTHER_FAILURES>", "^" * len(line.strip()))
    )


def _nproc_per_node(argv: list[str]) -> str:
    """torchrun's `--nproc_per_node` (or `--nproc-per-node`) value as given, "1" without one."""
    for i, arg in enumerate(argv):
        for name in ("--nproc_per_node", "--nproc-per-node"):
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
    return "1"


def main(argv: list[str]) -> int:
    if "-m" not in argv:
        print(
            f"{ERROR_PREFIX} usage: python -m titanlab.launcher [--preflight] [torchrun "
            "options] -m titanlab.train [trainer options]",
            file=sys.stderr,
        )
        return 2
    preflight = argv[:1] == ["--preflight"]
    if preflight:  # the check runs in torchrun's agent process (`titanlab.planning.agent`)
        argv = argv[1:]
        agent = ["-m", "titanlab.planning.agent", "--preflight", _nproc_per_node(argv)]
    else:
        agent = ["-m", "torch.distributed.run"]
    trainer_args = argv[argv.index("-m") + 2 :]
    with tempfile.TemporaryDirectory(prefix="titanlab-errors-") as errors:
        return _supervise([sys.executable, *agent, *argv], trainer_args, errors, preflight)


def _supervise(command: list[str], trainer_args: list[str], errors: str, preflight: bool) -> int:
    """Run torchrun's agent (`command`) and report as the module says. With `preflight`, the
    agent checks the config first: what it prints before `PREFLIGHT_PASSED` goes to the
    terminal as it is, and the log in the dump folder is opened only after that line, so that a
    refused config writes nothing."""
    log = None if preflight else open(log_path(dump_folder(trainer_args)), "a", encoding="utf-8")
    env = dict(os.environ, **{ERROR_DIR_ENV: errors})
    proc = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1
    )
    held: list[str] = []  # the ranks' error lines, printed once, last
    stopped: list[int] = []

    def forward(signum, _frame):  # preemption: torchrun passes SIGTERM on to every rank
        stopped.append(signum)
        if os.environ.get(FORWARD_SIGNALS_ENV, "1") != "0":
            proc.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, forward)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if log is None:  # the pre-flight check's output, its refusal the last line
                if line.rstrip("\n") == PREFLIGHT_PASSED:
                    log = open(log_path(dump_folder(trainer_args)), "a", encoding="utf-8")
                else:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                continue
            log.write(line)
            log.flush()
            text = line.rstrip("\n")
            bare = re.sub(r"^\[[^\]]*\]:", "", text)
            if bare.startswith(ERROR_PREFIX):
                held.append(bare)
            elif not is_launcher_noise(text):
                sys.stderr.write(line)
                sys.stderr.flush()
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    finally:
        if log is not None:
            log.close()
    if log is None:  # the check refused the config, or the agent died before torchrun
        return code
    report = log.name
    if code == 0 or (stopped and read_error_files(errors) is None):
        return code  # success, or stopped by a signal (run_train.sh reports preemption)
    recorded = read_error_files(errors)
    if recorded is not None:
        rank_code, line = recorded
    elif held:
        rank_code, line = code, held[0]
    else:
        rank_code, line = (
            code,
            (
                f"{ERROR_PREFIX} training failed (torchrun exit code {code});"
                " the failing rank's output is above"
            ),
        )
    print(f"titanlab: launcher report (torchrun's traceback): {report}", file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    return rank_code if rank_code > 0 else code
