"""The MoE A/B on the ledger (issue 94, `tools/ledger_moe_ab.py`): torchtitan 0.2.2's MoE step
(`tools/lib/torchtitan_moe_ledger.py`) priced beside titanlab's on the same shapes, as rank 0
of FSDP 8 with expert parallel 8. The harness gives torchtitan's exchange a balanced router's
splits (as titanlab's is priced) and counts its host syncs; titanlab's fastest step beats
torchtitan's fastest at the flavors' depth (make test-full)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from titanlab.distributed.init import destroy_distributed, init_fake_world
from titanlab.ledger.loop import ledger_of_loop
from tools import ledger_moe_ab as ab
from tools.lib.torchtitan_moe_ledger import step_builder

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan (the dev extra)"
    ),
    pytest.mark.xdist_group("ledger"),
]
MODELS = {m.family: m for m in ab.MODELS}
NO_AC = ("--activation_checkpoint.mode", "none")
FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"


def torchtitan_ledger(model, options, layers):
    shape = model.shape(layers)
    init_fake_world(ab.RANKS, "cpu")
    try:
        build = step_builder(shape, list(options), dp_shard=ab.RANKS, ep=ab.EP)
        return ledger_of_loop(build, "h100", shape.seq_len, 0.0, "torchtitan", shape.seq_len)
    finally:
        destroy_distributed(barrier=False)


def _token_exchanges(ledger) -> list[int]:
    """Bytes of each all-to-all of token rows (not the per-expert counts)."""
    return sorted(op.bytes_read for op in ledger.ops
                  if "all_to_all" in op.op and len(op.shape) == 2)  # fmt: skip


def test_torchtitans_exchange_moves_a_balanced_routers_tokens_with_one_host_sync_each():
    model = MODELS["qwen3_moe"]
    ours, theirs = ab.titanlab_ledger(model, NO_AC, 2), torchtitan_ledger(model, NO_AC, 2)
    exchanged = _token_exchanges(theirs)
    # dispatch and combine, forward and backward, of 2 blocks: S·k rows of dim bf16 each
    assert len(exchanged) == 8 and set(exchanged) == {4096 * 8 * 2048 * 2}
    assert _token_exchanges(ours) == exchanged  # titanlab's exact exchange, priced balanced too
    syncs = [op for op in theirs.ops if op.kind == "sync"]
    assert [op.op for op in syncs] == ["torchtitan.expert_parallel.splits"] * 2  # one a dispatch


@pytest.mark.skipif(not FULL, reason="make test-full: 3 ledgers at the flavor's depth, ~6 min")
@pytest.mark.parametrize("family", list(MODELS))
def test_titanlabs_fastest_moe_step_beats_torchtitans_fastest_at_full_depth(family):
    """titanlab's pieces (compiled, full AC, capacity 1.25 in 2 chunks) against the faster of
    torchtitan's compiled rows (full AC, per-op selective AC), on 8 ranks at the flavor's depth
    (measured 2026-12-07: Qwen3-30B-A3B 508.9 against 654.2 ms, 1.29x; DeepSeek-V3 16B 316.7
    against 346.0 ms, 1.09x: issue 94's 1.2x is not met there)."""
    model, rows = MODELS[family], {r.name: r for r in ab.ROWS}
    theirs = min(torchtitan_ledger(model, rows[name].torchtitan, None).priced.step_s
                 for name in ("compiled · full AC", "compiled · per-op selective AC"))  # fmt: skip
    ours = ab.titanlab_ledger(model, rows["titanlab pieces · torchtitan's fastest"].titanlab, None)
    print(f"{model.name}: titanlab {ours.priced.step_s * 1e3:.1f} ms, torchtitan "
          f"{theirs * 1e3:.1f} ms, {theirs / ours.priced.step_s:.2f}x")  # fmt: skip
    assert ours.priced.step_s < theirs
