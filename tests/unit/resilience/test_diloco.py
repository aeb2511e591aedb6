"""`titanlab.resilience.diloco`: what a checkpoint takes of DiLoCo (the last syncs' weights and
the outer momentum) is all a run resumed between two syncs needs to continue as if never
stopped, plain or streaming; without it, the continuation differs. Streaming's fragments are
consecutive blocks of balanced size, every weight in exactly one."""

from __future__ import annotations

import copy

import pytest
import torch

from titanlab.config.errors import ConfigError
from titanlab.config.fault_tolerance import FaultTolerance

pytest.importorskip("torchft")

from titanlab.resilience.diloco import DiLoCoState, fragment_names


class OneGroup:
    """torchft's Manager as one replica group alone sees it: every quorum is itself, an
    all-reduce leaves the tensor as it is, every step commits."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.step = 0

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def allreduce(self, tensor, should_quantize: bool = False):
        return self

    def wait(self) -> bool:
        return True

    def should_commit(self) -> bool:
        self.step += 1
        return True


PLAIN = FaultTolerance(enable=True, semi_sync_method="diloco", sync_steps=4)
STREAMING = FaultTolerance(enable=True, semi_sync_method="diloco", sync_steps=4, fragments=2,
                           fragment_update_alpha=0.5)  # fmt: skip
LOCAL_SGD = FaultTolerance(enable=True, semi_sync_method="diloco", sync_steps=4, outer_lr=1.0,
                           outer_momentum=0.0)  # fmt: skip


def _run(model, inner, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        inner.zero_grad()
        model(torch.randn(3, 8, generator=gen)).square().mean().backward()
        inner.step()  # DiLoCo's hook syncs after every 4th


def _fresh(model, cfg):
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    return inner, DiLoCoState(OneGroup(), cfg, model, inner, torch.device("cpu"))


@pytest.mark.parametrize(
    "cfg", [PLAIN, STREAMING, LOCAL_SGD], ids=["plain", "streaming", "local-sgd"]
)
def test_a_run_resumed_between_syncs_continues_exactly(cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inner, diloco = _fresh(model, cfg)
    _run(model, inner, range(1, 8))  # syncs every 4 (a fragment every 2); stopped after step 7
    saved = (copy.deepcopy(model), copy.deepcopy(inner.state_dict()),
             copy.deepcopy(diloco.state_dict()))  # fmt: skip
    if cfg.outer_momentum:
        assert all(m.abs().sum() > 0 for m in saved[2]["momentum"].values())  # each stepped
    _run(model, inner, range(8, 13))
    want = {k: v.clone() for k, v in model.state_dict().items()}

    finals = {}
    for resumed in (True, False):
        again = copy.deepcopy(saved[0])
        inner2, diloco2 = _fresh(again, cfg)
        inner2.load_state_dict(copy.deepcopy(saved[1]))
        diloco2.resume(7)
        if resumed:
            diloco2.load_state_dict(copy.deepcopy(saved[2]))
        _run(again, inner2, range(8, 13))
        finals[resumed] = again.state_dict()
    assert all(torch.equal(finals[True][k], want[k]) for k in want)
    assert not all(torch.equal(finals[False][k], want[k]) for k in want)  # the state matters


class Decoder(torch.nn.Module):
    """The shape of titanlab's decoders: an embedding, blocks under `layers`, a norm, an output
    projection (tied to the embedding when `tied`)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(100, 8)  # 800 weights
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))  # 72 each
        self.norm = torch.nn.LayerNorm(8, bias=False)  # 8
        self.output = torch.nn.Linear(8, 100, bias=False)  # 800
        if tied:
            self.output.weight = self.tok_embeddings.weight


def test_fragments_are_consecutive_blocks_of_balanced_size_each_weight_once():
    names = [n for n, _ in Decoder().named_parameters()]
    one, two = fragment_names(Decoder(), 2)
    assert one + two == names  # consecutive, in the model's order, every weight once
    # the cut where the running count (800, 872, 944, 1016 of 1888) passes half
    assert one == ["tok_embeddings.weight", *(f"layers.{i}.{w}" for i in range(3)
                                              for w in ("weight", "bias"))]  # fmt: skip
    tied = [n for names in fragment_names(Decoder(tied=True), 2) for n in names]
    assert tied == [n for n, _ in Decoder(tied=True).named_parameters()]
    assert "output.weight" not in tied  # the tied weight once, as the embedding
    assert len(fragment_names(Decoder(), 7)) == 7  # a block each
    with pytest.raises(ConfigError, match="fragments=8 is more than the model's 7 blocks"):
        fragment_names(Decoder(), 8)
