"""The `[fault_tolerance]` section: replica groups on torchft that keep training when one dies."""

from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass
from typing import Literal

from titanlab.config.errors import _require

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft's managers read the lighthouse's address from."""


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one of `replica_count` replica groups joined by torchft (`pip install
    titanlab[ft]`): each group is its own launch, with any layout inside it that has no
    dp_replicate and no pipeline (FSDP, TP, CP, EP and their products), and across groups
    torchft's managed process group takes the place of HSDP's dp_replicate dimension.
    A group that dies is left out of the quorum while the others keep stepping; relaunched,
    it recovers the weights and optimizer state from a live peer. `run_train.sh` and `titanlab
    train` start the lighthouse and the groups (docs/multinode.md, "Fault-tolerant HSDP")."""

    replica_id: int = 0
    """This group's index, 0 ≤ replica_id < replica_count (the launchers set it per group)."""

    replica_count: int = 1
    """Replica groups of the job: together they read the data as HSDP with dp_replicate =
    replica_count would, each group its own share."""

    min_replicas: int = 1
    """Groups a step needs to commit; with fewer the step waits for the quorum."""

    lighthouse: str = ""
    """The lighthouse's address (http://host:port); empty: $TORCHFT_LIGHTHOUSE, which the
    launchers set when they start it."""

    quorum_timeout_seconds: float = 60.0
    """How long a group waits for a quorum (or a lighthouse that does not answer) before it
    stops with one line naming the address."""

    timeout_seconds: float = 30.0
    """Timeout of the collectives across groups and of a recovery's transfer, in seconds: a
    group that stops answering is left out of the step after this long."""

    semi_sync_method: Literal["", "diloco"] = ""
    """"": fault-tolerant HSDP (gradients averaged across groups every step). "diloco": DiLoCo
    (Douillard et al. 2023, arXiv:2311.08105; torchft's `DiLoCo`): each group steps its own
    optimizer (the inner one, `[optimizer]`: AdamW or Muon) on its own data, and every
    `sync_steps` steps the groups average their parameter change since the last sync, which an
    outer Nesterov SGD applies to the weights of that sync."""

    sync_steps: int = 20
    """DiLoCo's H: inner steps between two outer steps."""

    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""

    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9); 0: plain SGD, and with outer_lr 1
    each sync averages the groups' weights (local SGD)."""

    fragments: int = 1
    """Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512): the model split into this
    many fragments of consecutive blocks (the embedding with the first, the final norm and
    output with the last), synced in turn, one every sync_steps / fragments inner steps, so an
    exchange carries 1/fragments of the weights and each fragment still syncs every sync_steps.
    1: plain DiLoCo. Must divide sync_steps."""

    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo's α: after a fragment's outer step its weights are (1 - α) × the outer
    result + α × this group's own; 0 takes the outer result."""

    def lighthouse_address(self) -> str:
        """`lighthouse`, else $TORCHFT_LIGHTHOUSE, else ""."""
        return self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")

    def validate(self) -> None:
        _require(
            self.replica_count >= 1,
            f"fault_tolerance.replica_count={self.replica_count} must be >= 1",
        )
        _require(
            0 <= self.replica_id < self.replica_count,
            f"fault_tolerance.replica_id={self.replica_id} must be in [0, "
            f"{self.replica_count - 1}] (replica_count={self.replica_count})",
        )
        _require(
            1 <= self.min_replicas <= self.replica_count,
            f"fault_tolerance.min_replicas={self.min_replicas} must be in [1, "
            f"replica_count={self.replica_count}]",
        )
        _require(self.sync_steps >= 1, f"fault_tolerance.sync_steps={self.sync_steps} must be >= 1")
        _require(
            self.outer_lr > 0 and 0 <= self.outer_momentum < 1,
            f"fault_tolerance.outer_lr={self.outer_lr} must be > 0 and outer_momentum="
            f"{self.outer_momentum} in [0, 1)",
        )
        _require(
            self.fragments >= 1 and self.sync_steps % self.fragments == 0,
            f"fault_tolerance.fragments={self.fragments} must be >= 1 and divide "
            f"sync_steps={self.sync_steps}",
        )
        _require(
            0 <= self.fragment_update_alpha <= 1,
            f"fault_tolerance.fragment_update_alpha={self.fragment_update_alpha} must be in [0, 1]",
        )
        for name in ("quorum_timeout_seconds", "timeout_seconds"):
            value = getattr(self, name)
            _require(
                value > 0 and math.isfinite(value),
                f"fault_tolerance.{name}={value} must be a number of seconds > 0",
            )
        _require(
            not self.semi_sync_method or self.enable,
            f"fault_tolerance.semi_sync_method={self.semi_sync_method} needs "
            "fault_tolerance.enable=true (DiLoCo syncs replica groups); add it, or drop "
            "semi_sync_method",
        )
        if self.lighthouse:
            _require(
                _is_http_address(self.lighthouse),
                f"fault_tolerance.lighthouse={self.lighthouse!r} is not an address like "
                f"http://host:port (e.g. {_example_address(self.lighthouse)})",
            )


def _is_http_address(address: str) -> bool:
    """Whether `address` reads as torchft's managers read the lighthouse's: http(s)://host:port."""
    parsed = urllib.parse.urlsplit(address)
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number, or out of range
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and port is not None


def _example_address(address: str) -> str:
    """`address` as http://host:port where that is what was meant (`localhost:29510`)."""
    fixed = f"http://{address}"
    return fixed if "://" not in address and _is_http_address(fixed) else "http://localhost:29510"


def validate_fault_tolerance(config) -> None:
    """The layouts a replica group can train in (`config.fault_tolerance.enable`): FSDP, TP, CP
    or EP inside a group, the groups themselves being the replicas. Raises ConfigError."""
    p = config.parallelism
    _require(
        p.data_parallel_replicate_degree == 1,
        f"fault_tolerance.enable=true with parallelism.data_parallel_replicate_degree="
        f"{p.data_parallel_replicate_degree}: the replica groups are the replicas; set it to 1 "
        "and fault_tolerance.replica_count to the number of groups",
    )
    _require(
        p.pipeline_parallel_degree == 1,
        f"fault_tolerance.enable=true with parallelism.pipeline_parallel_degree="
        f"{p.pipeline_parallel_degree} is not supported yet; use FSDP, TP, CP or EP inside a group",
    )
    _require(
        config.rl.algorithm == "none",
        f"fault_tolerance.enable=true with rl.algorithm={config.rl.algorithm} is not supported "
        "yet; use it for pretraining and supervised fine-tuning",
    )
    _require(
        config.training.mixed_precision_param != "float16",
        "fault_tolerance.enable=true with training.mixed_precision_param=float16 is not "
        "supported (the groups' loss scalers would diverge); use bfloat16",
    )
