"""Steps that do not log leave their values on the device: no `.item()`-style read (the aten op
`_local_scalar_dense` behind `.item()`, `float()`, `int()`, `bool()` of a tensor) happens in
titanlab's code on those steps; and a loss that goes non-finite between logging steps still stops
the run at the next one, naming the step where it happened. `training.skip_nonfinite_steps`
(off by default) costs one read per step, its own, and nothing more."""

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY

# Reads of host tensors are not waits for an accelerator and are left out: torch.optim's
# Adam/AdamW step counters (host tensors unless `capturable`) and the preemption flag (a host
# tensor reduced over gloo on every backend; see titanlab/resilience/preemption.py).
ALLOWED = ("/torch/optim/", "/titanlab/resilience/preemption.py")


class ScalarReads(TorchDispatchMode):
    """Records the Python stack of every read of tensor values into Python: the aten op behind
    `.item()`/`float()`/`int()`/`bool()`, and `.tolist()` / `.numpy()` (which read the memory
    directly, without an aten op; `watch` patches them while the mode is active)."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: list[list[str]] = []

    def record(self) -> None:
        frames = traceback.extract_stack()[:-2]
        if not any(a in f.filename for f in frames for a in ALLOWED):
            self.stacks.append([f"{f.filename}:{f.lineno} {f.line}" for f in frames[-8:]])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.record()
        return func(*args, **(kwargs or {}))

    def watch(self, monkeypatch) -> None:
        for name in ("tolist", "numpy"):
            real = getattr(torch.Tensor, name)

            def wrapped(t, *a, _real=real, **k):
                self.record()
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


def run(monkeypatch, tmp_path, dataset, *args: str) -> tuple[int, dict[int, list], list[int]]:
    """train.main in this process; returns (exit code, reads per step, steps run)."""
    from titanlab import train

    reads: dict[int, list] = {}
    ran: list[int] = []
    real_loop_step = train.Trainer._loop_step

    def loop_step(self, data, last, preemption):
        mode = ScalarReads()
        try:
            with monkeypatch.context() as patch, mode:
                mode.watch(patch)
                real_loop_step(self, data, last, preemption)
        finally:  # a step that raised ran too
            reads[self.step] = mode.stacks
            ran.append(self.step)

    monkeypatch.setattr(train.Trainer, "_loop_step", loop_step)
    code = train.main(
        [*TINY, "--data.dataset_path", dataset, "--job.dump_folder", str(tmp_path), *args]
    )
    return code, reads, ran


def test_only_steps_that_log_read_device_values(monkeypatch, tmp_path, tiny_dataset):
    code, reads, ran = run(
        monkeypatch, tmp_path / "run", tiny_dataset, "--training.steps", "8",
        "--metrics.log_freq", "4", "--checkpoint.enable", "false",
    )  # fmt: skip
    assert code == 0 and ran == list(range(1, 9))
    for step in (2, 3, 5, 6, 7):
        assert reads[step] == [], (step, reads[step])
    for step in (1, 4, 8):  # logging steps: one transfer of the window's values (and no more)
        assert reads[step], step


def test_a_diverged_loss_is_found_by_the_next_logging_step_and_named(
    monkeypatch, tmp_path, tiny_dataset, capsys
):
    named, stopped = {}, {}
    for log_freq in (1, 4):
        code, _, ran = run(
            monkeypatch, tmp_path / f"run{log_freq}", tiny_dataset, "--training.steps", "12",
            "--metrics.log_freq", str(log_freq), "--checkpoint.enable", "false",
            "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
        )  # fmt: skip
        assert code == 3
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("titanlab: error: loss is ")
        assert "last complete checkpoint: none" in last
        named[log_freq] = int(last.split(" at step ")[1].split(";")[0])
        stopped[log_freq] = ran[-1]
    # Logging every step finds the first non-finite loss at once (lr 1e30 breaks the weights in
    # the first update); logging every 4th names the same step and stops at the next multiple.
    k = named[1]
    assert 1 < k < 8 and stopped[1] == k
    assert named[4] == k and stopped[4] == -(-k // 4) * 4


def test_the_non_finite_step_check_reads_the_loss_and_norm_once_per_step(
    monkeypatch, tmp_path, tiny_dataset
):
    code, reads, ran = run(
        monkeypatch, tmp_path / "run", tiny_dataset, "--training.steps", "8",
        "--metrics.log_freq", "4", "--checkpoint.enable", "false",
        "--training.skip_nonfinite_steps", "3",
    )  # fmt: skip
    assert code == 0 and ran == list(range(1, 9))
    for step in (2, 3, 5, 6, 7):  # before the update: titanlab/resilience/nonfinite.py's read
        assert len(reads[step]) == 1, (step, reads[step])
        assert "/titanlab/resilience/nonfinite.py" in reads[step][0][-1], reads[step][0]
