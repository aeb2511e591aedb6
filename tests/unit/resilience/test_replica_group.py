"""`titanlab.resilience.replica_group`: the gradient averaged over the groups of a quorum, and
the one-line refusals when torchft's lighthouse is missing or does not answer."""

import os

import pytest
import torch
import torch.distributed as dist

from titanlab.config.errors import ConfigError
from titanlab.config.fault_tolerance import FaultTolerance
from titanlab.distributed.init import destroy_distributed
from titanlab.resilience.replica_group import ReplicaGroup


class QuorumOfTwo:
    """A stand-in for torchft's Manager in a quorum of this group and one peer whose flat
    buffer is `peer`: allreduce sums the two (ReduceOp.SUM), as the managed process group
    does."""

    def __init__(self, peer: torch.Tensor) -> None:
        self.peer = peer

    def allreduce(self, tensor, reduce_op):
        assert reduce_op == dist.ReduceOp.SUM
        tensor.add_(self.peer)
        return self

    def wait(self):
        return True

    def num_participants(self) -> int:
        return 2


def test_the_gradient_is_the_sum_of_the_groups_shares():
    """Each group's gradient is its share of the job's mean token loss (over the job's token
    count): summed with the peer's, with the loss."""
    ours, theirs = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, -1.0, 0.5])
    our_loss, their_loss = 60.0, 25.0
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = ours.clone()
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.manager = QuorumOfTwo(torch.cat([theirs, torch.tensor([their_loss])]))
    loss = group.sum_gradients([param, frozen], torch.tensor(our_loss))
    torch.testing.assert_close(param.grad, ours + theirs)
    assert loss.item() == our_loss + their_loss
    assert frozen.grad is None


@pytest.fixture
def one_rank_store(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0",
                           WORLD_SIZE="1").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        destroy_distributed(barrier=False)


def test_an_unreachable_lighthouse_is_one_line_naming_its_address(one_rank_store):
    cfg = FaultTolerance(enable=True, lighthouse="http://localhost:9", quorum_timeout_seconds=1)
    with pytest.raises(ConfigError) as raised:
        ReplicaGroup(cfg, None, None, torch.device("cpu"), lambda: 0, lambda step: None)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("fault_tolerance: the lighthouse at http://localhost:9 did not "
                              "answer within 1 s (")  # fmt: skip


def test_no_lighthouse_at_all_is_one_line(one_rank_store):
    with pytest.raises(ConfigError, match="needs a lighthouse: set fault_tolerance.lighthouse"):
        ReplicaGroup(FaultTolerance(enable=True), None, None, torch.device("cpu"), lambda: 0, print)
    assert "TORCHFT_LIGHTHOUSE" not in os.environ


def test_no_quorum_in_time_is_one_line_also_from_diloco_s_hook(one_rank_store):
    """A lighthouse waiting for 2 groups, this one alone: the quorum's timeout is
    `QuorumTimeout`, one line, whether the step asks for the quorum or DiLoCo's optimizer hook
    does (it calls the manager's start_quorum, which the group wraps)."""
    from titanlab.resilience.failures import QuorumTimeout
    from titanlab.resilience.ft_launch import start_lighthouse

    lighthouse, address = start_lighthouse(min_replicas=2)
    try:
        cfg = FaultTolerance(enable=True, lighthouse=address, quorum_timeout_seconds=1,
                             replica_count=2, min_replicas=2)  # fmt: skip
        group = ReplicaGroup(cfg, None, None, torch.device("cpu"), lambda: 3, print)
        try:
            for ask in (group.start_step, group.manager.start_quorum):
                with pytest.raises(QuorumTimeout) as raised:
                    ask()
                assert str(raised.value).startswith(
                    "fault_tolerance: replica group 0 found no quorum of min_replicas=2 groups "
                    "within quorum_timeout_seconds=1 after step 3 (lighthouse http"
                )
                assert "\n" not in str(raised.value)
        finally:
            group.shutdown()
    finally:
        lighthouse.kill()
