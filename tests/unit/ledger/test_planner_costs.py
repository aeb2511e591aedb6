"""The planner's compute costs priced by the ledger (`titanlab.ledger.planner_costs`): scaled to
the whole model on one device they give the ledger of the whole model, for every family."""

import os

import pytest

from titanlab.config.manager import build_config
from titanlab.ledger.planner_costs import (
    MIN_RANKS,
    ac_options,
    costs_of,
    fsdp_run,
    ledger_costs,
    ranks,
)
from titanlab.ledger.price import Priced
from titanlab.ledger.record import OpRecord
from titanlab.ledger.run import Ledger, build_ledger
from titanlab.models.registry import FAMILIES, get_family, get_flavor
from titanlab.planning.cluster import get_profile
from titanlab.planning.model_shape import ModelShape
from titanlab.planning.perf_model import predict
from titanlab.planning.planner import layout_of, model_args_of, run_of


def _ledger(ops: list[tuple[str, str, float]], extra: tuple = ()) -> Ledger:
    records = [OpRecord(op="mm", module=m, phase=phase, kind="gemm") for m, phase, _ in ops]
    records += [record for record, _ in extra]
    ops = [*ops, *(("", "", s) for _, s in extra)]
    seconds = [s for _, _, s in ops]
    priced = Priced(records, seconds, sum(seconds), 0.0, 0.0)
    return Ledger(records, priced, get_profile("h100"), 1, 1.0, "test", 0.0)


def test_dense_first_blocks_weigh_by_the_model_counts():
    # DeepSeek-V3 671B: 3 dense blocks of 61; the shortened copy's block 0 is dense, 1-2 MoE
    ledger = _ledger([
        ("layers.0.attention", "forward", 1.0), ("layers.1.moe", "forward", 3.0),
        ("layers.1.moe", "backward", 2.0), ("layers.2.moe", "forward", 5.0),
        ("output", "forward", 7.0), ("tok_embeddings", "backward", 0.5),
        ("", "optimizer", 8.0), ("", "grad_norm", 2.0),
    ], extra=(  # FSDP's copies, priced per byte its collectives move
        (OpRecord("fsdp.all_gather_copy_in.default", "layers.0", "forward", "other"), 3.0),
        (OpRecord("aten._foreach_copy_.default", "layers.1", "backward", "other"), 1.0),
        (OpRecord("c10d._allgather_base_.default", "layers.0", "forward", "collective",
                  collective="all_gather", bytes_read=100), 9.0),
        (OpRecord("c10d._reduce_scatter_base_.default", "layers.0", "backward", "collective",
                  collective="reduce_scatter", bytes_read=300), 9.0),
    ))  # fmt: skip
    costs = costs_of(ledger, n_layers=61, dense_first=3, params=5)
    assert costs.block_s == pytest.approx((3 * 1.0 + 58 * 5.0) / 61)
    assert (costs.head_s, costs.embedding_s) == (7.0, 0.5)
    assert costs.update_s_per_param == 10.0 / (5 / MIN_RANKS)  # per parameter a rank holds
    assert costs.fsdp_copy_s_per_byte == 4.0 / 400
    plain = costs_of(ledger, n_layers=61, dense_first=0, params=5)
    assert plain.block_s == pytest.approx((1.0 + 5.0 + 5.0) / 3)
    assert plain.sequence_s(4, True, False) == pytest.approx(4 * 11 / 3 + 7.0)


def test_ac_mode_names_map_to_the_trainer_options():
    assert ac_options("none") == ["--activation_checkpoint.mode", "none"]
    assert ac_options("selective_2")[-1] == "2" and ac_options("selective_op")[-1] == "op"
    with pytest.raises(ValueError, match="selective_x"):
        ac_options("selective_x")


def _scaled_and_whole(argv: list[str], ep: int = 1) -> tuple[float, float, object]:
    """The planner's compute, update and FSDP copies of the priced run's own layout from
    `ledger_costs`, the ledger's compute of that run (collectives apart), and the costs."""
    whole = build_ledger([*argv, *fsdp_run(ep)], "h100").priced.compute_s
    costs = ledger_costs(argv, "h100")
    config = build_config([*argv, *fsdp_run(ep), "--comm.mode", "fake_backend"])
    shape = ModelShape.of(model_args_of(config))
    world = ranks(ep)
    lay, run = layout_of(config, world, 1), run_of(config, "cuda", world)
    assert lay.ep == ep
    step = predict(shape, run, lay, get_profile("h100"), costs("none", ep))
    return step.compute_s + step.optimizer_s + step.fsdp_overhead_s, whole, costs


def _moe(family: str) -> bool:
    return hasattr(get_flavor(get_family(family), "debugmodel"), "moe")


def _cost_cases() -> list:
    """Every family at EP 1 and every MoE family at EP 2 (make test-full); CI meets every family
    once, a dense one at EP 1 and an MoE one at EP 2, and the MoE path at EP 1 with Qwen3-MoE."""
    full = os.environ.get("TITANLAB_PARITY_FULL") == "1"
    cases = [(f, 1) for f in sorted(FAMILIES)] + [(f, 2) for f in sorted(FAMILIES) if _moe(f)]
    skip = pytest.mark.skipif(not full, reason="make test-full: every family at EP 1")
    return [pytest.param(f, ep, marks=skip if ep == 1 and _moe(f) and f != "qwen3_moe" else ())
            for f, ep in cases]  # fmt: skip


@pytest.mark.parametrize("family, ep", _cost_cases())
def test_costs_scaled_to_the_model_give_its_ledger(family, ep):
    # 5%: at debug sizes the update's per-tensor launch floors do not scale with parameters
    argv = ["--model.name", family, "--model.flavor", "debugmodel", "--training.seq_len", "256"]
    scaled, whole, costs = _scaled_and_whole(argv, ep)
    assert scaled == pytest.approx(whole, rel=0.05)
    if family == "llama3":  # full AC's recomputation is priced
        assert costs("full").block_s > costs("none").block_s


def test_costs_at_a_real_shape_give_its_ledger():
    # Llama 3.2 1B at seq 2048: its 16 blocks from the ledger of 2
    scaled, whole, _ = _scaled_and_whole(["--model.flavor", "1B", "--training.seq_len", "2048"])
    assert scaled == pytest.approx(whole, rel=0.03)  # -1.9% on 2026-11-30
