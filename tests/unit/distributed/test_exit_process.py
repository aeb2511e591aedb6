"""`exit_process`: the exit status, the output and the exit handlers survive the fast exit of a
single process (objects frozen out of the final collections) and of a rank under torchrun
(interpreter finalization skipped)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = """
import atexit, sys
from titanlab.distributed.init import exit_process, hold_group_threads
if len(sys.argv) > 2:
    hold_group_threads()
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
print("last line", end="")  # unflushed: no newline, stdout is a pipe
exit_process(3)
"""


@pytest.mark.parametrize(
    "world_size, own_group",
    [("1", False), ("2", False), ("1", True)],
    ids=["one-process", "torchrun-rank", "replica-group-of-one"],
)
def test_status_and_output_survive_the_exit(tmp_path, world_size, own_group):
    marker = tmp_path / "marker"
    env = dict(os.environ, WORLD_SIZE=world_size)
    argv = [sys.executable, "-c", SCRIPT, str(marker), *(["own-group"] if own_group else [])]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "last line"
    # A single process runs its exit handlers; a torchrun rank, and a process with a process
    # group of its own (a fault-tolerant replica group of one rank), skip them with
    # finalization.
    assert marker.exists() == (world_size == "1" and not own_group)
