"""An MoE block compiled whole (`apply_compile(moe="whole")`, `moe_compile_mode`): routing,
top-k, permutation, grouped experts, combine, shared expert and load-balance loss trace as one
graph (`fullgraph=True`) and train like eager code, on one process and under expert parallel
with the capacity-bounded exchange (2 gloo ranks); its statistics are counted once, also when
an activation checkpoint recomputes it. bf16 with `torch._grouped_mm`, the GPU's path (run
here on the CPU's grouped GEMM); the exact exchange and the per-expert loop are not traced
(their splits are read on the host), so `moe_compile_mode` leaves them eager. Under FSDP
the block compiles in pieces: test_moe_compile_pieces.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed
from titanlab.models.common.moe import MoE, MoEArgs

DIM, EXPERTS, TOP_K, TOKENS = 32, 8, 2, 16


def _layer() -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=32, num_shared_experts=1,
                   load_balance_coeff=0.01)  # fmt: skip
    moe = MoE(DIM, args)
    moe.init_weights(0.05)
    moe.experts.use_grouped_mm = True  # the GPU's path (bf16 grouped GEMM)
    moe.aux_grad_scale = 1.0
    # as FSDP's bf16 mixed precision computes: the router in fp32 (it keeps the gate so), the
    # grouped experts cast to bf16 activations' dtype, the shared expert's weights in bf16
    moe.shared_experts.bfloat16()
    return moe


def _step(moe: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, ac: bool = False) -> dict:
    xi = x.clone().requires_grad_()
    out = checkpoint(moe, xi, use_reentrant=False) if ac else moe(xi)
    out.backward(grad)
    grads = {n: p.grad for n, p in moe.named_parameters()}
    grads = {n: g.to_local() if hasattr(g, "to_local") else g for n, g in grads.items()}
    return {"out": out.detach(), "x_grad": xi.grad, **grads}


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16)
    return x, torch.randn_like(x)


def _assert_alike(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_graph_that_trains_like_eager_and_counts_once(backend):
    x, grad = _inputs(1)
    eager = _layer()
    want = _step(eager, x, grad)
    compiled = _layer()
    explained = torch._dynamo.explain(compiled)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled.tokens_per_expert.zero_()
    compiled.step_aux.zero_()
    compiled.compile(backend=backend, fullgraph=True)
    # aot_eager runs eager's kernels; Inductor fuses the bf16 pointwise ops (its own rounding)
    _assert_alike(_step(compiled, x, grad), want, atol=0 if backend == "aot_eager" else 2e-2)
    assert torch.equal(compiled.tokens_per_expert, eager.tokens_per_expert)
    assert compiled.tokens_per_expert.sum() == TOKENS * TOP_K
    # under activation checkpointing the recomputation in backward counts nothing
    _step(compiled, x, grad, ac=True)
    assert compiled.tokens_per_expert.sum() == 2 * TOKENS * TOP_K
    torch.testing.assert_close(compiled.step_aux, 2 * eager.step_aux, rtol=1e-5, atol=0)


def _ep_layers(world: int, chunks: int) -> list[MoE]:
    """Two identical MoE layers under EP over `world` gloo ranks, the capacity exchange in
    `chunks` chunks with a factor that never drops (E / top_k)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanlab.distributed.expert_parallel import apply_ep

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    layers = []
    for _ in range(2):
        holder = torch.nn.Module()
        holder.moe = _layer()
        apply_ep(holder, mesh, capacity_factor=EXPERTS / TOP_K, dispatch_chunks=chunks)
        layers.append(holder.moe)
    return layers


def _ep_worker(rank: int, world: int, init_file: str, out_dir: str, chunks: int) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        eager, compiled = _ep_layers(world, chunks)
        x, grad = _inputs(100 + rank)
        explained = torch._dynamo.explain(compiled)(x)
        compiled.tokens_per_expert.zero_()
        compiled.step_aux.zero_()
        compiled.compile(backend="aot_eager", fullgraph=True)
        results = {
            "graphs": (explained.graph_count, explained.graph_break_count),
            "eager": _step(eager, x, grad),
            "compiled": _step(compiled, x, grad, ac=True),
            "counts": (eager.tokens_per_expert.clone(), compiled.tokens_per_expert.clone()),
            "dropped": compiled.tokens_dropped.clone(),
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("chunks", [1, 2])
def test_under_expert_parallel_with_a_capacity_it_is_one_graph_that_trains_like_eager(
    chunks, tmp_path
):
    """Also with the exchange overlapped in 2 chunks (`parallelism.expert_dispatch_chunks`)."""
    spawn(_ep_worker, (2, str(tmp_path / "init"), str(tmp_path), chunks), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["graphs"] == (1, 0)
        _assert_alike(got["compiled"], got["eager"], atol=0)
        assert torch.equal(*got["counts"]) and got["counts"][0].sum() == TOKENS * TOP_K
        assert got["dropped"].item() == 0


def _schedule(code: str) -> list[tuple[str, str]]:
    """The order of an Inductor graph's all-to-alls, waits and grouped GEMMs in its generated
    wrapper code: ("a2a", result buffer), ("wait", buffer), ("gemm", "")."""
    events = []
    for line in code.splitlines():
        line = line.strip()
        if "_c10d_functional.all_to_all_single.default(" in line and " = " in line:
            events.append(("a2a", line.split(" = ")[0]))
        elif line.startswith("torch.ops._c10d_functional.wait_tensor.default("):
            events.append(("wait", line.split("(")[1].rstrip(")")))
        elif "extern_kernels._grouped_mm(" in line:
            events.append(("gemm", ""))
    return events


def beside(events: list[tuple[str, str]]) -> list[int]:
    """For each all-to-all of a schedule, in issue order, the grouped GEMMs between its issue
    and its wait: the compute it runs beside."""
    issued = {buf: i for i, (kind, buf) in enumerate(events) if kind == "a2a"}
    waited = {buf: i for i, (kind, buf) in enumerate(events) if kind == "wait" and buf in issued}
    return [events[issued[b] : waited.get(b, issued[b])].count(("gemm", "")) for b in issued]


def _inductor_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        import torch._inductor.config
        from torch._inductor.utils import run_and_get_code

        from titanlab.distributed.compile import overlap_in_graph_collectives

        eager, compiled = _ep_layers(world, 2)
        overlap_in_graph_collectives()  # what apply_compile(overlap_collectives=True) sets
        torch._inductor.config.fx_graph_cache = False  # the graph of this process's groups
        torch._inductor.config.benchmark_harness = False  # its code reads sys.argv
        compiled.compile(backend="inductor", fullgraph=True)
        x, grad = _inputs(100 + rank)
        results: dict = {"eager": _step(eager, x, grad)}
        results["compiled"], code = run_and_get_code(_step, compiled, x, grad)
        results["schedules"] = [_schedule(c) for c in code]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        torch._inductor.config.reorder_for_compute_comm_overlap = False
        destroy_distributed(barrier=ok)


def test_an_exchange_in_chunks_compiled_by_inductor_runs_its_all_to_alls_beside_the_experts(
    tmp_path,
):
    """2 chunks, 2 gloo ranks, the layer compiled by Inductor with `overlap_in_graph_collectives`:
    in the forward graph chunk 1's dispatch runs beside chunk 0's expert GEMMs and chunk 0's
    combine beside chunk 1's (the first dispatch and the last combine have nothing to run
    beside), in the backward graph 3 of its 4 all-to-alls run beside GEMMs. Dynamo traces each
    wait right after its collective: without the passes none overlaps, with `sink_waits`
    alone 1 of the backward's (measured). The layer trains like eager (Inductor's bf16
    rounding)."""
    spawn(_inductor_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        _assert_alike(got["compiled"], got["eager"], atol=2e-2)
        forward, backward = got["schedules"]
        # D0 alone, D1 beside chunk 0's w1, w3, w2; C0 beside chunk 1's; C1 alone
        assert beside(forward) == [0, 3, 3, 0], forward
        # each but the first beside the other chunk's gradient GEMMs (the last beside the
        # weight gradients)
        assert len(beside(backward)) == 4 and all(beside(backward)[1:]), backward


def _moe_decoder(ac_mode: str, family_name: str = "qwen3_moe") -> torch.nn.Module:
    """`family_name`'s debug flavor cut to the fewest blocks (at least 2) that hold an MoE
    block, without multi-token prediction, bf16 on the grouped GEMMs, under `ac_mode`."""
    import dataclasses

    from titanlab.distributed.activation_checkpoint import apply_ac
    from titanlab.models.common.decoder import moe_layer_args
    from titanlab.models.registry import get_family

    family = get_family(family_name)
    flavor = family.flavors["debugmodel"]
    blocks = next(n for n in range(2, flavor.n_layers + 1)
                  if moe_layer_args(dataclasses.replace(flavor, n_layers=n)))  # fmt: skip
    args = dataclasses.replace(flavor, n_layers=blocks, vocab_size=256)
    if hasattr(args, "mtp_layers"):  # a plain forward does not run the MTP depths
        args = dataclasses.replace(args, mtp_layers=0)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    model.bfloat16()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.experts.use_grouped_mm = True
        moe.router.float()  # as mixed precision keeps the gate
        moe.aux_grad_scale = 1.0
    apply_ac(model, ac_mode, "op")
    return model


def _moe_families() -> list[str]:
    """The registered families whose debug flavor has MoE blocks."""
    from titanlab.models.common.decoder import moe_layer_args
    from titanlab.models.registry import FAMILIES, get_family

    return [f for f in FAMILIES if moe_layer_args(get_family(f).flavors["debugmodel"])]


CASES = [("qwen3_moe", "none", True), ("qwen3_moe", "full", True)]
CASES += [(family, "selective", True) for family in _moe_families()]
CASES += [(family, "full", False) for family in _moe_families()]


@pytest.mark.parametrize(
    "family, ac_mode, whole",
    CASES,
    ids=[f"{f}-{a}-{'whole' if w else 'eager-moe'}" for f, a, w in CASES],
)
def test_a_decoder_with_moe_blocks_compiled_trains_like_eager(family, ac_mode, whole):
    """`apply_compile(moe="whole")` on a 2-block Qwen3-MoE without AC and under full AC, and
    on every MoE family (Qwen3-MoE; DeepSeek-V3, MLA and shared experts; gpt-oss, biased and
    clamped experts; Qwen3.5-MoE, Gated DeltaNet blocks) under per-op selective AC (the block
    compiled around its checkpoint); and every family's blocks compiled with the MoE layer
    eager (`moe="eager"`: the exact exchange, per-op SAC under FSDP; each other child compiled,
    torch norms by `compile_forward`) under full AC: logits and every gradient equal eager bitwise
    (aot_eager), each layer's tokens counted once."""
    from titanlab.distributed.compile import apply_compile, forward_compiled

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))

    def step(model):
        out = model(tokens)
        out.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        return {"logits": out.detach(), **grads}, [m.tokens_per_expert.clone() for m in layers]

    want, want_counts = step(_moe_decoder(ac_mode, family))
    compiled = _moe_decoder(ac_mode, family)
    apply_compile(compiled, "aot_eager", moe="whole" if whole else "eager")
    if not whole:
        inner = [getattr(b, "_checkpoint_wrapped_module", b) for b in compiled.layers.values()]
        inner = [b for b in inner if any(isinstance(m, MoE) for m in b.modules())]
        children = [c for b in inner for c in b.children() if not isinstance(c, MoE)]
        assert children and all(
            forward_compiled(c) if type(c).__module__.startswith("torch.")
            else c._compiled_call_impl is not None for c in children
        )  # fmt: skip
    got, got_counts = step(compiled)
    _assert_alike(got, want, atol=0)
    assert got_counts and all(torch.equal(g, w) for g, w in zip(got_counts, want_counts))
    top_k = [m.args.top_k for m in compiled.modules() if isinstance(m, MoE)]
    assert all(c.sum() == 2 * 32 * k for c, k in zip(got_counts, top_k))


def _matmuls(graph: torch.fx.Graph) -> list[str]:
    """The matmul ops of an AOTAutograd graph, in order: "mm" and "grouped"."""
    names = {torch.ops.aten.mm.default: "mm", torch.ops.aten._grouped_mm.default: "grouped"}
    return [names[n.target] for n in graph.nodes if n.target in names]


@pytest.mark.parametrize("ac_mode", ["none", "selective"])
def test_per_op_selective_ac_keeps_every_other_matmul_inside_the_compiled_block(ac_mode):
    """Compiled around its checkpoint, the MoE block's backward graph (AOTAutograd's
    partition) recomputes exactly the matmuls the per-op policy does not keep: every
    even-numbered forward matmul, the experts' grouped GEMMs counted with the dense ones; each
    forward matmul also has its two gradient matmuls. Without AC nothing is recomputed. An
    eager SAC region around compiled code would recompute all of them (the whole block)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from titanlab.distributed.compile import apply_compile

    graphs: dict[str, list[list[str]]] = {"forward": [], "backward": []}

    def keep(phase):
        def compiler(gm, example_inputs):
            graphs[phase].append(_matmuls(gm.graph))
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()  # a graph cached by another test would skip the compilers
    model = _moe_decoder(ac_mode)
    apply_compile(model, aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")),
                  moe="whole")  # fmt: skip
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    model(tokens).float().pow(2).mean().backward()
    forward, backward = graphs["forward"][0], graphs["backward"][0]
    assert forward.count("grouped") == 3 and forward.count("mm") >= 5  # w1, w3, w2; attention
    recomputed = forward[1::2] if ac_mode == "selective" else []
    for kind in ("mm", "grouped"):
        want = 2 * forward.count(kind) + recomputed.count(kind)
        assert backward.count(kind) == want, (kind, forward, backward)
    assert recomputed.count("grouped") in (1, 2) or ac_mode == "none"


AC_OPTIONS = [
    [],
    ["--activation_checkpoint.mode", "full"],
    ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
     "op"],
]  # fmt: skip


@pytest.mark.parametrize("options", AC_OPTIONS, ids=["none", "full", "selective-op"])
def test_how_the_moe_layer_compiles_on_each_layout(options):
    """On an H100's code path, bf16: whole on one GPU under any AC; in pieces under FSDP (EP 8
    over dp_shard 8 with a capacity factor's static exchange: the router's and experts' own
    FSDP units) and under DDP, but eager there under per-op selective AC; eager with the exact
    exchange and in fp32; on the CPU's code path (the per-expert loop) eager unless
    `model.moe_grouped_mm = "on"`, and then in bf16 only."""
    from titanlab.config.device_path import Target, code_path_of
    from titanlab.config.manager import build_config
    from titanlab.distributed.compile import moe_compile_mode
    from titanlab.distributed.parallel_dims import ParallelDims

    base = ["--job.config_file", "train_configs/qwen3_moe_debug.toml", *options]
    config = build_config(base)
    exact = build_config([*base, "--parallelism.expert_parallel_degree", "8"])
    capacity = build_config([*base, "--parallelism.expert_parallel_degree", "8",
                             "--parallelism.expert_capacity_factor", "1.25"])  # fmt: skip
    forced = build_config([*base, "--model.moe_grouped_mm", "on"])
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1, ep=1)
    fsdp = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, pp=1, world_size=8, ep=8)
    ddp = ParallelDims(dp_replicate=8, dp_shard=1, cp=1, tp=1, pp=1, world_size=8, ep=1)
    data_parallel = "eager" if "op" in options else "pieces"
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    with code_path_of(Target("cuda", (9, 0))):
        assert moe_compile_mode(config, one, cuda, bf16) == "whole"
        assert moe_compile_mode(capacity, fsdp, cuda, bf16) == data_parallel
        assert moe_compile_mode(config, ddp, cuda, bf16) == data_parallel
        assert moe_compile_mode(exact, fsdp, cuda, bf16) == "eager"
        assert moe_compile_mode(config, one, cuda, torch.float32) == "eager"
    assert moe_compile_mode(config, one, cpu, bf16) == "eager"
    assert moe_compile_mode(forced, one, cpu, bf16) == "whole"
    # fp32 grouped GEMMs run eagerly on the CPU, but Dynamo's fake kernel takes bf16 alone
    assert moe_compile_mode(forced, one, cpu, torch.float32) == "eager"
