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


class ScriptedQuorums:
    """A stand-in for torchft's Manager whose successive quorums hold `sizes[i]` groups; the
    step jumps to `healed_step` at quorum `heal_at` (this group received a peer's later
    step); a `None` size is a quorum not formed in time. Its all-reduce sums one per group
    of the current quorum."""

    def __init__(self, sizes, heal_at=None, healed_step=0) -> None:
        self.sizes, self.heal_at, self.healed_step = list(sizes), heal_at, healed_step
        self.quorums, self.step = 0, 0

    def start_quorum(self, timeout=None) -> None:
        if self.sizes[self.quorums] is None:
            raise TimeoutError("no quorum")
        if self.quorums == self.heal_at:
            self.step = self.healed_step
        self.quorums += 1

    def num_participants(self) -> int:
        return self.sizes[self.quorums - 1] if self.quorums else self.sizes[0]

    def current_step(self) -> int:
        return self.step

    def allreduce(self, tensor, reduce_op):
        tensor.fill_(self.num_participants())
        return self

    def wait(self):
        return True

    def errored(self):
        return None


def scripted_group(manager, replica_count=3, quorum_timeout_seconds=30.0) -> ReplicaGroup:
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.cfg = FaultTolerance(enable=True, replica_count=replica_count, min_replicas=2,
                               quorum_timeout_seconds=quorum_timeout_seconds)  # fmt: skip
    group.manager, group.device, group.diloco, group._joined = (
        manager,
        torch.device("cpu"),
        None,
        False,
    )
    group._start_quorum = manager.start_quorum
    return group


def test_the_first_quorum_waits_for_every_group():
    """A launch's first step: quorums of 1 and 2 of the 3 groups are passed over; the step
    runs in the first that holds all 3; the next step asks once."""
    manager = ScriptedQuorums([1, 2, 3, 2])
    group = scripted_group(manager)
    group.start_step()
    assert manager.quorums == 3
    group.start_step()
    assert manager.quorums == 4  # a group that falls behind later is not waited for


def test_a_group_that_joins_a_running_job_does_not_wait_for_the_others():
    """Its first quorum gave it a peer's later step: the job is running without a group."""
    manager = ScriptedQuorums([2, 3], heal_at=0, healed_step=7)
    scripted_group(manager).start_step()
    assert manager.quorums == 1


def test_past_the_quorum_timeout_the_first_step_runs_with_the_groups_that_came(caplog):
    manager = ScriptedQuorums([2] * 1000)
    scripted_group(manager, quorum_timeout_seconds=0.3).start_step()
    assert 1 < manager.quorums < 1000
    assert "2 of 3 replica groups joined within quorum_timeout_seconds=0.3" in caplog.text


def test_after_the_last_step_a_group_waits_for_a_quorum_of_every_group():
    """The last step's quorum held 2 of 3 groups (one was behind): the next quorum holds all 3
    (the one behind received the last step in it), and the groups leave after meeting in it."""
    manager = ScriptedQuorums([2, 2, 3])
    manager.quorums = 1  # the last step's quorum
    scripted_group(manager).finish()
    assert manager.quorums == 3


def test_a_group_whose_peers_are_gone_ends_with_a_warning(caplog):
    manager = ScriptedQuorums([2, None])
    manager.quorums = 1
    scripted_group(manager).finish()
    assert "replica group 0 ends at the last step without the other groups" in caplog.text
