"""`titanlab train`: what `./run_train.sh` does, in Python, so that an installed wheel trains too.

    titanlab train [CONFIG_FILE] [--section.key VALUE ...]

CONFIG_FILE is a path, or the name of a config titanlab ships (`debug_model.toml`,
`train_configs/llama_8b.toml`, found from any directory: `titanlab.config.shipped`); without
one, the debug model's. The same environment as run_train.sh:
  NGPU          processes to start (default: the CUDA GPUs nvidia-smi lists, else 2 CPU
                processes); with --comm.mode fake_backend, the world size the dry run simulates
  LOG_RANK      ranks whose output is shown (default 0; e.g. LOG_RANK=0,1)
  MAX_RESTARTS  times torchrun restarts the whole group after a rank fails (default 0)
  MASTER_PORT   the rendezvous port on localhost (default 0: a free one)
  OMP_NUM_THREADS  intra-op threads per process (default 1)
The interpreter is this one (`sys.executable`), not $PYTHON.

The same steps, with the same exit codes (0 done, 2 bad config, 3 diverged, 4 hang, 5 out of
memory, 75 preempted: requeue):
1. comm.mode fake_backend or local_tensor (from the config or the command line): this process
   becomes `python -m titanlab.train` (exec), without torchrun.
2. `titanlab.resilience.launcher --preflight` starts torchrun's agent, which first runs the
   pre-flight check (`titanlab.preflight` with `--nproc NGPU`, in the agent's process:
   `titanlab.planning.agent`): a hopeless config fails in seconds with one line and nothing
   written. Fault-tolerant replica groups started here (`ft_launch`): the check runs once,
   before the lighthouse and the groups.
3. Then torchrun starts the ranks; the launcher shows their output, the failing rank's one
   error line last; SIGTERM or SIGUSR1 reach the ranks as SIGTERM. When rank 0 stopped for
   preemption after saving, the exit code is 75.
The launching process imports neither torch nor the trainer: the agent and the ranks do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

from titanlab.config.errors import ConfigError
from titanlab.config.manager import load_toml
from titanlab.config.shipped import DEFAULT_CONFIG, resolve_config_file
from titanlab.config.fault_tolerance import LIGHTHOUSE_ENV
from titanlab.resilience import ft_launch, launcher

PROG = "titanlab train"
SINGLE_PROCESS_MODES = ("fake_backend", "local_tensor")


@dataclass
class Launch:
    """What `titanlab train ARGV` runs: the config, its overrides and the processes."""

    config_file: str
    overrides: list[str]
    comm_mode: str
    nproc: str = ""  # NGPU, as given (the pre-flight check validates it)
    replica_groups: int = 0  # fault tolerance: groups started here with a lighthouse
    min_replicas: int = 1
    torchrun: list[str] = field(default_factory=list)  # titanlab.launcher's arguments

    def trainer_args(self) -> list[str]:
        """The arguments of `titanlab.train` (and of the pre-flight check after `--nproc`)."""
        return ["--job.config_file", self.config_file, *self.overrides]


def split_config(argv: list[str]) -> tuple[str, list[str]]:
    """(CONFIG_FILE, overrides) of `argv`: a first argument that is not an option is the config
    (as in run_train.sh), else a `--job.config_file F` among the options, else the debug
    model's config. The config is resolved by `titanlab.config.shipped.resolve_config_file`.

    Raises:
        ConfigError: the config file neither exists nor names a shipped config.
    """
    rest = list(argv)
    config = ""
    if rest and not rest[0].startswith("--"):
        config = rest.pop(0)
    for i, arg in enumerate(rest):
        if not config and arg == "--job.config_file" and i + 1 < len(rest):
            config = rest[i + 1]
            del rest[i : i + 2]
            break
        if not config and arg.startswith("--job.config_file="):
            config = arg.split("=", 1)[1]
            del rest[i]
            break
    return resolve_config_file(config or DEFAULT_CONFIG), rest


def config_value(config_file: str, overrides: list[str], section: str, key: str) -> str:
    """`section.key` of the run as a string: the last `--section.key` on the command line, else
    the config file's (empty when neither sets it, or the file cannot be read: the pre-flight
    check reports it)."""
    value = ""
    try:
        table = load_toml(config_file).get(section, {})
        found = table.get(key, "") if isinstance(table, dict) else ""
        value = str(found).lower() if isinstance(found, bool) else str(found)
    except ConfigError:
        pass
    option = f"--{section}.{key}"
    for i, arg in enumerate(overrides):
        if arg == option and i + 1 < len(overrides):
            value = overrides[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def comm_mode(config_file: str, overrides: list[str]) -> str:
    """comm.mode of the run (`config_value`)."""
    return config_value(config_file, overrides, "comm", "mode")


def local_replica_groups(config_file: str, overrides: list[str], env: dict[str, str]) -> int:
    """Replica groups this machine starts itself with a lighthouse (`ft_launch`): the
    fault_tolerance.replica_count of a fault-tolerant run given no lighthouse (neither
    fault_tolerance.lighthouse nor $TORCHFT_LIGHTHOUSE); 0 otherwise (one launch: a plain run,
    or one group of a job whose lighthouse runs elsewhere)."""

    def value(key: str) -> str:
        return config_value(config_file, overrides, "fault_tolerance", key)

    if value("enable") not in ("true", "1") or value("lighthouse") or env.get(LIGHTHOUSE_ENV):
        return 0
    count = value("replica_count") or "1"
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"fault_tolerance.replica_count={count} must be an integer >= 1")
    return int(count)


def gpu_count() -> int:
    """CUDA GPUs that `nvidia-smi -L` lists (0 without nvidia-smi): the same count as
    run_train.sh's, without initializing CUDA in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU") for line in out.splitlines())


def plan_launch(argv: list[str], env: dict[str, str]) -> Launch:
    """What `titanlab train ARGV` runs under the environment `env`, without running it.

    Raises:
        ConfigError: as `split_config`.
    """
    config_file, overrides = split_config(argv)
    launch = Launch(config_file, overrides, comm_mode(config_file, overrides))
    if launch.comm_mode in SINGLE_PROCESS_MODES:
        return launch
    launch.nproc = env.get("NGPU") or str(gpu_count() or 2)
    launch.replica_groups = local_replica_groups(config_file, overrides, env)
    minimum = config_value(config_file, overrides, "fault_tolerance", "min_replicas")
    launch.min_replicas = int(minimum) if minimum.isdigit() else 1
    launch.torchrun = [
        "--preflight",
        f"--nproc_per_node={launch.nproc}",
        f"--max-restarts={env.get('MAX_RESTARTS', '0')}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=localhost:{env.get('MASTER_PORT', '0')}",
        f"--local-ranks-filter={env.get('LOG_RANK', '0')}",
        "--role=rank",
        "--tee=3",
        "-m",
        "titanlab.train",
        *launch.trainer_args(),
    ]
    return launch


def run(launch: Launch, prog: str = PROG) -> int:
    """Run `launch` (see the module's steps) and return the exit code.

    Raises:
        OSError: the interpreter could not be started (the exec of a one-process mode).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # several threads per rank on shared cores
    python = sys.executable
    if launch.comm_mode in SINGLE_PROCESS_MODES:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(python, [python, "-m", "titanlab.train", *launch.trainer_args()])
    marker = os.path.join(tempfile.gettempdir(), f"titanlab-preempt.{uuid.uuid4().hex[:12]}")
    os.environ[launcher.MARKER_ENV] = marker
    if launch.replica_groups:
        if not launch.nproc.isdigit():
            raise ConfigError(f"NGPU={launch.nproc} must be a positive integer")
        # the config checked once, before the lighthouse and any group start (each group's
        # launcher would check it again, and a refusal would come once per group, late)
        check = [python, "-m", "titanlab.preflight", "--nproc", launch.nproc,
                 *launch.trainer_args()]  # fmt: skip
        code = subprocess.run(check).returncode
        if code != 0:
            return code
        torchrun = [arg for arg in launch.torchrun if arg != "--preflight"]
        log = launcher.log_path(launcher.dump_folder(launch.trainer_args()), "lighthouse")
        code = ft_launch.run_groups(torchrun, int(launch.nproc), launch.replica_groups,
                                    launch.min_replicas, gpu_count(), log)  # fmt: skip
    else:
        code = launcher.main(launch.torchrun)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            step = f.read().strip()
        os.remove(marker)
        print(f"{prog}: preempted after step {step}; exit 75 to requeue", file=sys.stderr)
        return launcher.REQUEUE_EXIT_CODE
    return code


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """`titanlab train`: parse `argv` (CONFIG_FILE, then `--section.key VALUE` overrides) and
    train. `--help` prints this usage and the trainer's options. A bad config file is one
    `titanlab: error:` line and exit code 2; other codes are the run's (see the module)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        paragraphs = __doc__.split("\n\n")  # title, usage, config and environment, ...
        usage = paragraphs[1].strip().replace("titanlab train", prog, 1)
        options = subprocess.run(  # the trainer's reference, less its own usage line
            [sys.executable, "-m", "titanlab.train", "--help"], capture_output=True, text=True
        )
        reference = options.stdout.split("\n", 1)[-1] if options.stdout.startswith("usage:") else ""
        print(f"usage: {usage}\n\n{paragraphs[2]}\n{reference or options.stdout}", end="")
        sys.stderr.write(options.stderr)
        return options.returncode
    try:
        launch = plan_launch(argv, dict(os.environ))
        return run(launch, prog)
    except ConfigError as e:
        print(f"titanlab: error: {e}", file=sys.stderr)
        return 2
