"""One rank's side of fault-tolerant HSDP across replica groups (`[fault_tolerance]`, torchft).

Each replica group is its own launch: its ranks shard the model (FSDP, TP, CP, EP) as any
run does, and across groups torchft's `Manager` (one per rank, its managed process group
configured anew for every quorum the lighthouse forms) stands where HSDP's dp_replicate
all-reduce was. One step:

1. `start_step`: the quorum of the groups alive now. A group behind the others (relaunched
   after a failure) first receives their state from a live peer (`state_dict` /
   `load_state_dict`: this rank's shards of the weights and optimizer state, the LR schedule,
   the step), rank by rank. The first quorum of a launch waits for every group
   (`_wait_for_every_group`), so that no group trains steps alone while another is still
   starting.
2. forward and backward inside the group, as without fault tolerance, except that what HSDP
   sums over dp_replicate is summed over the groups of the quorum too (`step_sum`): the step's
   token count, and MoE's load statistics.
3. `sum_gradients`: each group's gradient is its share of the mean token loss over the groups
   in the quorum; summed in one flat all-reduce with the loss, it is that loss's gradient.
4. `commit`: every group steps its optimizer only when the step succeeded everywhere in the
   quorum (torchft's should_commit); a step that failed (a peer died during it) is not
   committed and the trainer runs it again on the same batches.

After the last step, `finish` keeps a group in the job's quorums until every group has the
last step: a group one step behind (left out of a quorum) receives it from a live peer instead
of waiting alone for a quorum that can no longer form.

Source: torchft (https://github.com/pytorch/torchft, `Manager`: quorum, managed allreduce,
should_commit, recovery by HTTP transfer) and torchtitan's fault-tolerance experiment, which
wires the same steps into its trainer.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanlab.config.device_path import device_type
from titanlab.config.errors import ConfigError
from titanlab.config.fault_tolerance import FaultTolerance
from titanlab.resilience.diloco import DiLoCoState
from titanlab.resilience.failures import QuorumTimeout

logger = logging.getLogger("titanlab")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""The checkpointer's optimizer state dict: keyed by parameter name (`Checkpointer._optim_sd`)."""


def replica_name(replica_id: int) -> str:
    """The id a group gives the lighthouse (torchft reads its trailing digits as the index)."""
    return f"titanlab_replica_{replica_id}"


def group_dump_folder(dump_folder: str, replica_id: int) -> str:
    """Where a group writes its config, metrics and checkpoints: `<dump>/replica_<id>`."""
    return os.path.join(dump_folder, f"replica_{replica_id}")


def data_rank(cfg: FaultTolerance, dp_rank: int, dp: int) -> tuple[int, int]:
    """(data-parallel rank, degree) of a rank of group `cfg.replica_id` with in-group
    `dp_rank` of `dp`: the groups read the data as HSDP's replicas would."""
    return cfg.replica_id * dp + dp_rank, cfg.replica_count * dp


def _quiet_http_log(transport: Any) -> None:
    """No access-log line per request from the recovery server of torchft's `HTTPTransport`
    (http.server writes `"GET /checkpoint/1/full HTTP/1.1" 200` to stderr for each)."""
    server = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_message = lambda *args, **kwargs: None


def _local(value: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


class ReplicaGroup:
    """This rank's torchft `Manager` and the state a recovering peer receives from it.

    Args:
        cfg: the `[fault_tolerance]` section (enabled).
        checkpointer: the run's `Checkpointer` (its model and optimizer state dicts, in the
            layout every group shares, are what a recovery transfers).
        lr_scheduler: the run's LR schedule (state_dict / load_state_dict).
        device: this rank's device: gloo groups on CPU, NCCL on CUDA.
        trainer_step: the trainer's step (the last one completed; at first, the step this rank
            resumes after: its own checkpoint's, or 0).
        on_recovered: called with the step received when this group recovered from a peer.
    Raises:
        ConfigError: torchft is not installed, or the lighthouse does not answer within
            `quorum_timeout_seconds` (one line naming its address).
    """

    def __init__(
        self,
        cfg: FaultTolerance,
        checkpointer,
        lr_scheduler,
        device: torch.device,
        trainer_step: Callable[[], int],
        on_recovered: Callable[[int], None],
    ) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum
        # torchft reports each step, and a handled fault as a traceback of C++ frames; the
        # trainer says in one line what it did about it (a step run again, a recovery)
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # a recovery's received tensors are read-only views of the transfer buffer, copied
        # into the model at once (`_load_state_dict`)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        try:
            from torchft.checkpointing.http_transport import HTTPTransport
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ImportError:
            raise ConfigError(
                "fault_tolerance.enable=true needs torchft: pip install 'titanlab[ft]'"
            ) from None
        self.cfg = cfg
        self.checkpointer = checkpointer
        self.lr_scheduler = lr_scheduler
        self.on_recovered = on_recovered
        self.trainer_step = trainer_step
        self.device = device
        # a group torchrun restarted joins a running job: it must not wait for every group
        self._joined = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        step = trainer_step()
        address = cfg.lighthouse_address()
        if not address:
            raise ConfigError(
                "fault_tolerance.enable=true needs a lighthouse: set fault_tolerance.lighthouse "
                "or $TORCHFT_LIGHTHOUSE (run_train.sh and titanlab train start one)"
            )
        self.address = address
        timeout = timedelta(seconds=cfg.timeout_seconds)
        store_port = self._fresh_store()
        pg_class = ProcessGroupNCCL if device_type(device) == "cuda" else ProcessGroupGloo
        transport = HTTPTransport(timeout=timeout, num_chunks=0)  # torchft's default one
        _quiet_http_log(transport)
        try:
            self.manager = Manager(
                pg=pg_class(timeout=timeout),
                checkpoint_transport=transport,
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=cfg.min_replicas,
                use_async_quorum=False,  # a recovery completes before the step's forward
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
                replica_id=replica_name(cfg.replica_id),
                lighthouse_addr=address,
                store_addr=os.environ["MASTER_ADDR"],
                store_port=store_port,
                # every group draws the same initial weights (debug.seed) or loads the same
                # initial checkpoint: nothing to send at step 0
                init_sync=False,
            )
        except Exception as e:  # the Rust client's connection error, e.g. a timeout
            raise ConfigError(self._unreachable(e)) from None
        self._start_quorum = self.manager.start_quorum
        self.manager.start_quorum = self._quorum  # type: ignore[method-assign]
        self.diloco: DiLoCoState | None = None
        if cfg.semi_sync_method == "diloco":  # the manager counts fragment syncs
            (model,), (inner,) = checkpointer.model_parts, checkpointer.optimizer.optimizers
            self.diloco = DiLoCoState(self.manager, cfg, model, inner, device)
            self.diloco.resume(step)
            if not checkpointer.add_state("diloco", self.diloco) and step:
                logger.warning(
                    "fault tolerance: the checkpoint of step %d holds no DiLoCo state; DiLoCo "
                    "starts from its weights with no outer momentum, the next sync %d steps on",
                    step,
                    self.diloco.every - step % self.diloco.every,
                )
        else:
            self.manager.load_state_dict({"step": step, "batches_committed": step})

    def _fresh_store(self) -> int:
        """A store for this launch's managers (rank 0 serves it; its port reaches the other
        ranks by broadcast). Not the launcher's: torchrun keeps that one across the restarts
        of a group, where a restarted rank could read the dead manager's address."""
        port = [0]
        if dist.get_rank() == 0:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False
            )
            port = [self._store.port]
        dist.broadcast_object_list(port, src=0)
        return int(port[0])

    def _unreachable(self, e: Exception) -> str:
        lines = str(e).strip().splitlines()
        first = lines[0].rsplit(": ", 1)[-1] if lines else type(e).__name__  # the root cause
        return (
            f"fault_tolerance: the lighthouse at {self.address} did not answer within "
            f"{self.cfg.quorum_timeout_seconds:g} s ({first}); start it (torchft_lighthouse "
            "--min_replicas N) or let run_train.sh / titanlab train start it"
        )

    # --- the step --------------------------------------------------------------------------
    def start_step(self) -> None:
        """Join this step's quorum (and recover from a peer when this group is behind); under
        DiLoCo nothing (the quorum is formed at each outer step, in the optimizer's hook).

        Raises:
            QuorumTimeout: fewer than min_replicas groups for `quorum_timeout_seconds`.
        """
        if not self._joined:  # the launch's first quorum
            self._joined = True
            self._wait_for_every_group()
        elif self.diloco is None:
            self.manager.start_quorum()

    def _wait_for_every_group(self) -> None:
        """The first quorum of a launch: quorums until one holds all `replica_count` groups,
        or until this group received a live peer's later step (the job was already running),
        or, past `quorum_timeout_seconds`, with the groups that came (the others recover from a
        live peer when they join). Without it, the lighthouse forms a quorum of the groups
        already asking (min_replicas of them): the group that starts first trains steps alone
        while another still imports torch, which then recovers a later step with its data at
        the start, and the run is neither HSDP's nor reproducible. Under DiLoCo the inner steps
        begin together, and the first outer step forms its own quorum."""
        first = self.manager.current_step()
        deadline = time.monotonic() + self.cfg.quorum_timeout_seconds
        while True:
            self.manager.start_quorum()
            groups = self.manager.num_participants()
            if groups >= self.cfg.replica_count or self.manager.current_step() != first:
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "fault tolerance: %d of %d replica groups joined within "
                    "quorum_timeout_seconds=%g; training with them (a group that joins later "
                    "recovers from a live peer)",
                    groups,
                    self.cfg.replica_count,
                    self.cfg.quorum_timeout_seconds,
                )
                return
            time.sleep(0.1)

    def finish(self) -> None:
        """After the last step (fault-tolerant HSDP): stay in the job's quorums until one holds
        every group, each with the last step, so that a group left out of a late quorum (one
        step behind: it waits for a quorum at its last step) receives that step from a live
        peer and ends on the same weights, instead of waiting alone for a quorum that can no
        longer form. Each quorum's groups meet in a one-element all-reduce, which a recovering
        group reaches only after its transfer, so no group leaves while a peer still reads its
        state. Gives up, with a warning, after `quorum_timeout_seconds` without such a
        quorum (a group that died and was not restarted in time). Nothing under DiLoCo, whose
        groups end on their own inner steps."""
        if self.diloco is not None:
            return
        deadline = time.monotonic() + self.cfg.quorum_timeout_seconds
        while True:
            present = torch.ones((), device=self.device)
            self.manager.allreduce(present, reduce_op=ReduceOp.SUM).wait()
            if self.manager.errored() is None:
                if int(present.item()) >= self.cfg.replica_count:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self._start_quorum(timeout=timedelta(seconds=left))
            except TimeoutError:
                break
        logger.warning(
            "fault tolerance: replica group %d ends at the last step without the other "
            "groups: not every group reached it within quorum_timeout_seconds=%g",
            self.cfg.replica_id,
            self.cfg.quorum_timeout_seconds,
        )

    def _quorum(self, *args, **kwargs) -> None:
        """torchft's `Manager.start_quorum` (this instance's: DiLoCo's hook calls it too), with
        a quorum not formed in time as `QuorumTimeout`."""
        try:
            self._start_quorum(*args, **kwargs)
        except TimeoutError:
            raise QuorumTimeout(
                f"fault_tolerance: replica group {self.cfg.replica_id} found no quorum of "
                f"min_replicas={self.cfg.min_replicas} groups within quorum_timeout_seconds="
                f"{self.cfg.quorum_timeout_seconds:g} after step {self.trainer_step()} (lighthouse "
                f"{self.address}); the other groups have stopped or cannot be reached"
            ) from None

    def groups(self) -> int:
        """Replica groups in this step's quorum (DiLoCo: in the last outer step's; 1 before
        the first)."""
        return self.manager.num_participants() or 1

    def sum_gradients(
        self, params: Iterable[torch.nn.Parameter], loss_sum: torch.Tensor
    ) -> torch.Tensor:
        """Sum each gradient over the groups of the quorum: each group's is its share of the
        job's mean token loss (its token losses over the job's token count, `step_sum`), as
        each dp_replicate rank's is under HSDP, so the sum is the gradient of the job's loss.

        Args:
            params: this rank's parameters; the `.grad` of each trained one (a DTensor shard or
                a tensor; zeros where none) is this group's share.
            loss_sum: 0-d, this group's summed token loss (equal on its ranks).
        Returns:
            loss_sum summed over the groups of the quorum (float32, 0-d).
        A collective that fails (a peer died) leaves the step uncommitted (`commit`).
        """
        trained = [p for p in params if p.requires_grad]
        for p in trained:  # the same buffer layout in every group, used or not this step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in trained]
        flat = torch.cat(
            [g.detach().reshape(-1).float() for g in grads] + [loss_sum.detach().float().reshape(1)]
        )
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
        return flat[-1]

    def sum_over_groups(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """0-d `values` summed over the groups of the last quorum (as they are before the
        first: DiLoCo's first outer step forms it)."""
        if self.manager.num_participants() == 0:  # no quorum yet
            return values
        flat = torch.stack([v.detach().float().reshape(()) for v in values])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        return tuple(flat)

    def step_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the groups of this step's quorum, as HSDP sums over dp_replicate
        what the ranks of a global batch share (MoE's load-balance statistics: the expert
        loads and the balance loss's token fractions); `t` itself under DiLoCo, whose groups
        train on their own between syncs."""
        if self.diloco is not None:
            return t
        out = t.detach().clone()
        self.manager.allreduce(out, reduce_op=ReduceOp.SUM).wait()
        return out

    def commit(self) -> bool:
        """Whether every group of the quorum finished the step (then step the optimizer);
        always under DiLoCo, whose inner steps are each group's own."""
        if self.diloco is not None:
            return True
        return self.manager.should_commit()

    def shutdown(self) -> None:
        if self.diloco is not None:
            self.diloco.close()
        self.manager.shutdown(wait=False)

    # --- recovery --------------------------------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        """What a recovering peer's rank of the same index receives: this rank's shards."""
        return {
            "model": {k: _local(v) for k, v in self.checkpointer._model_sd().items()},
            "optimizer": {k: _local(v) for k, v in self.checkpointer._optim_sd().items()},
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "step": self.trainer_step(),  # under DiLoCo the manager counts outer steps
        }

    def _load_state_dict(self, received: dict[str, Any]) -> None:
        """Take a live peer's state (its shards of the same layout), in place."""
        ckpt = self.checkpointer
        model = ckpt._model_sd()
        optim = ckpt._optim_sd()  # creates the optimizer's state when it has none yet
        with torch.no_grad():
            for ours, theirs in ((model, received["model"]), (optim, received["optimizer"])):
                for key, value in ours.items():
                    if isinstance(value, torch.Tensor):
                        _local(value).copy_(theirs[key])
                    else:
                        ours[key] = theirs[key]
        (part,), (opt,) = ckpt.model_parts, ckpt.optimizer.optimizers  # no pipeline stages
        set_model_state_dict(part, model)
        set_optimizer_state_dict(part, opt, optim, options=_FLAT)
        self.lr_scheduler.load_state_dict(received["lr_scheduler"])
        step = int(received["step"])
        logger.warning(
            "fault tolerance: replica group %d recovered step %d from a live peer",
            self.cfg.replica_id,
            step,
        )
        self.on_recovered(step)
