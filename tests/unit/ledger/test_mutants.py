"""The ledger's gates against GPU-only regressions (docs/ledger.md, "Gates"): each mutant puts
one regression that no CPU test sees into a copy of the step (a monkeypatch, in the test, never
in the tree), and a named gate of `titanlab.ledger.gates` must fail with a line naming the
cause, while the same ledger without the mutant passes every gate. The cases are real shapes
(`test_gates.CASES`: 2 blocks at the real dims, seq_len 8192, H100 profile).

Mutants (each the name of a way a step regresses on the GPU only):
- fp32 head-gradient products: the fused loss's weight gradient as fp32 GEMMs (2026-11-27);
- causal attention on the math SDPA backend (`sdpa_kernel([SDPBackend.MATH])`);
- an explicit softmax(QKᵀ)V in the model's attention;
- `.item()` per gradient, `.cpu()` per gradient (host syncs);
- a clone of every gradient (memory traffic: the timing gate against the plain loop);
- `compile.backend = "aot_eager"` (compiled blocks without Inductor's fusion);
- expert parallel's all-to-alls priced as overlapped where they wait (the ledger's own defect
  before 2026-12-02, on the EP group that is also dp_shard's);
- fla's kernel disabled for Qwen3.5 (its gated delta rule in PyTorch).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.unit.ledger.test_gates import ledger_of
from tests.unit.ledger.test_trainer_overhead import MAX_OVERHEAD, plain_ledger, trainer_ledger
from titanlab.ledger import gates

pytestmark = pytest.mark.xdist_group("ledger")  # one worker: each ledger built once


@contextlib.contextmanager
def fp32_head_gradient(mp: pytest.MonkeyPatch) -> Iterator[None]:
    import titanlab.components.head_gradient as head_gradient

    def product(a, b, dtype):  # an in-place fp32 GEMM, which autocast leaves in fp32
        out = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
        return out.addmm_(a.float(), b.float())

    mp.setattr(head_gradient, "product", product)
    yield


def _wrapped_train_step(
    mp: pytest.MonkeyPatch, around: Callable[[], contextlib.AbstractContextManager]
):
    from titanlab.trainer.step import TrainStep

    original = TrainStep.train_step

    def train_step(self, batches):
        with around():
            return original(self, batches)

    mp.setattr(TrainStep, "train_step", train_step)


@contextlib.contextmanager
def math_sdpa(mp: pytest.MonkeyPatch) -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _wrapped_train_step(mp, lambda: sdpa_kernel([SDPBackend.MATH]))
    yield


@contextlib.contextmanager
def explicit_softmax(mp: pytest.MonkeyPatch) -> Iterator[None]:
    import titanlab.models.common.attention as attention

    def sdpa(q, k, v, attn_mask=None, is_causal=False, **kwargs):  # (bs, heads, seq, head_dim)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if is_causal:
            n = q.shape[-2]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return scores.float().softmax(-1).to(q.dtype) @ v

    mp.setattr(
        attention, "F", types.SimpleNamespace(**{**vars(F), "scaled_dot_product_attention": sdpa})
    )
    yield


def _per_gradient(mp: pytest.MonkeyPatch, read: Callable[[torch.Tensor], object]) -> None:
    import titanlab.trainer.step as step

    original = step.clip_grad_norm_

    def clip(parameters, *args, **kwargs):
        for p in parameters:
            if p.grad is not None:
                read(p.grad)
        return original(parameters, *args, **kwargs)

    mp.setattr(step, "clip_grad_norm_", clip)


@contextlib.contextmanager
def item_per_gradient(mp: pytest.MonkeyPatch) -> Iterator[None]:
    _per_gradient(mp, lambda g: g.abs().max().item())
    yield


@contextlib.contextmanager
def cpu_per_gradient(mp: pytest.MonkeyPatch) -> Iterator[None]:
    _per_gradient(mp, lambda g: g.cpu())
    yield


@contextlib.contextmanager
def clone_every_gradient(mp: pytest.MonkeyPatch) -> Iterator[None]:
    _per_gradient(mp, lambda g: g.clone())
    yield


@contextlib.contextmanager
def all_to_alls_overlapped(mp: pytest.MonkeyPatch) -> Iterator[None]:
    import titanlab.ledger.price as price

    original = price.overlaps
    mp.setattr(price, "overlaps", lambda op, dim: original(op, dim) or (
        op.collective == "all_to_all" and dim in price.OVERLAPPED))  # fmt: skip
    yield


@contextlib.contextmanager
def fla_disabled(mp: pytest.MonkeyPatch) -> Iterator[None]:
    import titanlab.models.common.linear_attention as linear_attention
    from titanlab.models.common import delta_rule

    mp.setattr(linear_attention, "chunked_rule", lambda x: delta_rule.chunked)
    yield


@dataclass(frozen=True)
class Mutant:
    apply: Callable[[pytest.MonkeyPatch], contextlib.AbstractContextManager]
    case: str
    """The gate case (`test_gates.CASES`) it is put into, or "plain-loop" (gate 3's pair)."""
    gate: str
    """The gate of `titanlab.ledger.gates.check` that must fail (or "plain-loop")."""
    cause: str
    """Text the gate's line must contain: what it names as the cause."""
    options: tuple[str, ...] = ()


MUTANTS = {
    "fp32-head-gradient": Mutant(fp32_head_gradient, "llama3-8b-bf16", "fp32_gemm_share", "output"),
    "math-sdpa": Mutant(math_sdpa, "llama3-8b-bf16", "attention_matrices", "8192, 8192)"),
    "explicit-softmax": Mutant(explicit_softmax, "llama3-8b-bf16", "attention_matrices",
                               "8192, 8192)"),
    "item-per-gradient": Mutant(item_per_gradient, "llama3-8b-bf16", "host_syncs",
                                "aten._local_scalar_dense"),
    "cpu-per-gradient": Mutant(cpu_per_gradient, "llama3-8b-bf16", "host_syncs", "Tensor.cpu"),
    "clone-every-gradient": Mutant(clone_every_gradient, "plain-loop", "plain-loop",
                                   "aten.clone.default"),
    "aot-eager": Mutant(contextlib.nullcontext, "llama3-8b-bf16", "unfused_in_compiled_blocks",
                        "outside Inductor's fused regions", ("--compile.backend", "aot_eager")),
    "all-to-alls-overlapped": Mutant(all_to_alls_overlapped, "deepseek-v3-16b-ep8",
                                     "hidden_all_to_alls", "all-to-alls"),
    "fla-disabled": Mutant(fla_disabled, "qwen3.5-35b-a3b-ep8", "fallback_kernels",
                           "fla's chunk_gated_delta_rule"),
}  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    return plain_ledger()


def failures(mutant: Mutant, plain, fresh: bool = True) -> dict[str, str]:
    """The gates the step fails, built now (`fresh`: under the mutant applied) or the case's
    ledger as the gate tests built it (`test_gates.ledger_of`'s cache)."""
    if mutant.case == "plain-loop":
        line = gates.slower_than(trainer_ledger(), plain, MAX_OVERHEAD, "the plain loop")
        return {"plain-loop": line} if line else {}
    build = ledger_of.__wrapped__ if fresh else ledger_of
    return gates.check(build(mutant.case, *mutant.options))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_gpu_regression_is_caught_by_its_named_gate(name, plain):
    mutant = MUTANTS[name]
    with pytest.MonkeyPatch.context() as mp, mutant.apply(mp):
        failed = failures(mutant, plain)
    print(f"{name}: {failed}")
    assert mutant.gate in failed, f"{name} passed {mutant.gate}: {failed}"
    assert mutant.cause in failed[mutant.gate], failed[mutant.gate]


@pytest.mark.parametrize("case", sorted({m.case for m in MUTANTS.values()}))
def test_the_cases_the_mutants_go_into_pass_every_gate(case, plain):
    clean = Mutant(contextlib.nullcontext, case, "", "")
    assert failures(clean, plain, fresh=False) == {}
