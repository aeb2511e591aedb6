"""Every activation-checkpointing mode gives the no-AC gradients and keeps fewer activation
bytes for backward.

Memory is the bytes of tensors created during forward that are still alive when forward ends:
what autograd saved, plus what op-level selective AC keeps in its own cache (which
saved-tensor hooks do not see)."""

import pytest
import torch

from titanlab.planning.activation_memory import LiveTensorBytes
from titanlab.distributed.activation_checkpoint import apply_ac
from titanlab.components.loss import cross_entropy_sum
from titanlab.models.llama3 import Transformer, TransformerModelArgs

ARGS = TransformerModelArgs(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32
)


def make_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def saved_bytes_and_grads(model):
    """Bytes alive after forward for backward (not counting the loss), and the gradients."""
    inputs, labels = batch()
    counter = LiveTensorBytes()
    with counter:
        loss = cross_entropy_sum(model(inputs), labels)
    saved = counter.live() - loss.untyped_storage().nbytes()
    loss.backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


def clean(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "")


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_ac_gradients_equal_and_memory_lower(mode, option):
    base_bytes, base_grads = saved_bytes_and_grads(make_model())
    model = make_model()
    apply_ac(model, mode, option)
    ac_bytes, grads = saved_bytes_and_grads(model)
    grads = {clean(n): g for n, g in grads.items()}
    assert grads.keys() == base_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, base_grads[name], atol=1e-6, rtol=0), name
    assert ac_bytes < 0.8 * base_bytes, (mode, option, ac_bytes, base_bytes)


def test_ac_modes_keep_memory_in_the_expected_order():
    kept = {}
    for mode, option in [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]:
        model = make_model()
        apply_ac(model, mode, option)
        kept[mode, option] = saved_bytes_and_grads(model)[0]
    # Full AC keeps each block's input; op-level SAC also keeps SDPA outputs and every other
    # matmul output; checkpointing every 2nd block keeps everything of the other half.
    assert (
        kept["full", "op"] < kept["selective", "op"] < kept["selective", "2"] < kept["none", "op"]
    )


def test_unknown_mode_is_one_line():
    with pytest.raises(
        ValueError, match=r"^activation_checkpoint.mode='half'; valid: none, full, selective$"
    ):
        apply_ac(make_model(), "half")


def test_op_sac_ignores_profiler_ranges_that_differ_in_the_recompute():
    """FSDP2's hooks on a module sharded on its own inside a block (the experts under expert
    parallel) open `record_function` ranges a different number of times in the recompute than
    in the forward; op-level SAC must not count them (it failed with "invocation index N ... not
    found in storage"). Here the block opens one extra range when it runs the second time."""
    calls = {"n": 0}

    class Annotated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            calls["n"] += 1
            for _ in range(calls["n"]):
                with torch.autograd.profiler.record_function("hook"):
                    x = self.lin(x).relu()
            return self.lin(x)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": Annotated()})

        def forward(self, x):
            return self.layers["0"](x)

    torch.manual_seed(0)
    model = Stack()
    apply_ac(model, "selective", "op")
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()  # the recompute runs the extra range (and an extra matmul)
    assert calls["n"] == 2 and x.grad is not None


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "1")])
def test_a_recomputed_block_draws_the_same_dropout_mask(mode, option):
    """LoRA adapter dropout under AC: the recompute must draw the forward's mask again (the RNG
    state is kept for blocks that hold dropout), else the gradients belong to another mask.
    They differed by 3e-3 before."""
    from titanlab.config.peft import Peft
    from titanlab.peft.lora import apply_lora, init_adapters

    def grads(ac_mode):
        model = make_model()
        apply_lora(model, Peft(method="lora", dropout=0.3, target_modules=["wq", "wo"]))
        init_adapters([model], 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.1)
        apply_ac(model, ac_mode, option)
        torch.manual_seed(5)
        inputs, labels = batch()
        cross_entropy_sum(model(inputs), labels).backward()
        return {clean(n): p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads("none"), grads(mode)
    assert plain.keys() == checkpointed.keys() and plain
    for name, g in plain.items():
        assert torch.equal(g, checkpointed[name]), name


class _CountAllToAlls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional all-to-alls dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops._c10d_functional.all_to_all_single.default
        return func(*args, **(kwargs or {}))


def _all_to_all_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import os

    from gloo_group import init_gloo
    from torch.distributed.device_mesh import init_device_mesh

    from titanlab.distributed.expert_parallel import apply_ep
    from titanlab.distributed.init import destroy_distributed
    from titanlab.models.common.moe import MoE, MoEArgs

    init_gloo(rank, world, init_file)
    ok = False
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        results = {}
        for mode in ("none", "selective"):
            torch.manual_seed(0)
            model = torch.nn.Module()
            moe = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8, num_shared_experts=1))
            moe.init_weights(0.05)
            model.layers = torch.nn.ModuleDict({"0": moe})
            apply_ep(model, mesh, capacity_factor=2.0)  # never drops: E / top_k
            apply_ac(model, mode, "op")
            torch.manual_seed(1 + rank)
            x = torch.randn(1, 6, 16, requires_grad=True)
            out = model.layers["0"](x)
            counter = _CountAllToAlls()
            with counter:
                out.pow(2).sum().backward()
            grads = {clean(n): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
            results[mode] = {"backward_all_to_alls": counter.count, "x": x.grad, **grads}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_op_sac_keeps_expert_parallels_all_to_alls(tmp_path):
    """An MoE layer under expert parallel (2 gloo ranks, the capacity exchange) and per-op SAC:
    its backward exchanges twice, the reverse of the dispatch and of the combine, as without
    AC; recomputing the forward's two all-to-alls would communicate again. Gradients equal."""
    from gloo_group import spawn

    spawn(_all_to_all_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        plain, sac = got["none"], got["selective"]
        assert plain["backward_all_to_alls"] == sac["backward_all_to_alls"] == 2
        assert plain.keys() == sac.keys()
        for name in plain:
            if name != "backward_all_to_alls":
                torch.testing.assert_close(sac[name], plain[name], atol=1e-6, rtol=0, msg=name)
