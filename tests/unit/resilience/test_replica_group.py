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
    buffer is `peer`: allreduce averages the two, as the managed process group does."""

    def __init__(self, peer: torch.Tensor) -> None:
        self.peer = peer

    def allreduce(self, tensor):
        tensor.add_(self.peer).div_(2)
        return self

    def wait(self):
        return True

    def num_participants(self) -> int:
        return 2


def test_the_gradient_is_the_token_weighted_mean_over_the_groups():
    ours, theirs = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, -1.0, 0.5])
    our_tokens, their_tokens, our_loss, their_loss = 30.0, 10.0, 60.0, 25.0
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = ours.clone()
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.manager = QuorumOfTwo(
        torch.cat([theirs * their_tokens, torch.tensor([their_loss, their_tokens])])
    )
    loss, tokens = group.average_gradients(
        [param], torch.tensor(our_loss), torch.tensor(our_tokens)
    )
    want = (ours * our_tokens + theirs * their_tokens) / (our_tokens + their_tokens)
    torch.testing.assert_close(param.grad, want)
    assert (loss.item(), tokens.item()) == (our_loss + their_loss, our_tokens + their_tokens)


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
        ReplicaGroup(cfg, None, None, torch.device("cpu"), 0, lambda step: None)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("fault_tolerance: the lighthouse at http://localhost:9 did not "
                              "answer within 1 s (")  # fmt: skip


def test_no_lighthouse_at_all_is_one_line(one_rank_store):
    with pytest.raises(ConfigError, match="needs a lighthouse: set fault_tolerance.lighthouse"):
        ReplicaGroup(FaultTolerance(enable=True), None, None, torch.device("cpu"), 0, print)
    assert "TORCHFT_LIGHTHOUSE" not in os.environ
