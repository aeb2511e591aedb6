"""Fault-tolerant HSDP without a fault equals plain HSDP, whatever each replica group's layout.

The layouts inside a group are generated: every layout of 2 ranks that the trainer's own
checks accept with `[fault_tolerance]` on (so no dp_replicate and no pipeline), for the dense
debug model, for the MoE one (expert parallel, with the load-balance loss and with the
expert-bias balancing) and for LoRA on the dense one. Each case: 2 groups (`titanlab train`: the lighthouse and a torchrun
per group; min_replicas 1, group 1 starting 5 s late) train 5 steps, the whole job stops and is launched again to step 8 (each group from
its own checkpoint), with validation every 4 steps; plain HSDP is the same layout with
dp_replicate 2 on 4 ranks. Every step's loss and validation loss are equal within 1e-5.
CI runs tensor parallel inside the groups (FSDP is in every test of test_fault_tolerance.py);
`make test-full` runs them all.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import CONSTANT_LR, PARITY_FULL, TINY, launch, read_metrics
from tests.integration.ft_runs import (
    GROUP_RANKS,
    finish,
    ft_args,
    group_metrics,
    group_metrics_of,
    late_group,
    titanlab_train,
)
from tests.coverage_spec import layout_cells
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning import preflight
from titanlab.planning.layouts import Layout, apply_layout, enumerate_layouts

pytest.importorskip("torchft")

FT = ("--fault_tolerance.enable", "true", "--fault_tolerance.replica_count", "2",
      "--fault_tolerance.min_replicas", "1")  # fmt: skip
"""min_replicas below replica_count: a step may commit without a group, so nothing but the
first quorum's wait for every group (and the lighthouse's wait for a live one) keeps a group
that starts late, or runs a little behind, in every step."""
MOE = ("--model.name", "qwen3_moe")
FAMILIES = {
    "dense": (),
    # a coefficient far above Qwen3's 0.001, so a wrongly reduced aux gradient shows
    "moe-aux": (*MOE, "--model.moe_load_balance_coeff", "0.1", "--model.moe_bias_update_speed",
                "0"),
    "moe-bias": (*MOE, "--model.moe_load_balance_coeff", "0", "--model.moe_bias_update_speed",
                 "0.01"),
    # LoRA on a frozen base: only the adapters' gradients cross the groups
    "lora": ("--peft.method", "lora"),
}  # fmt: skip
ROWS = 2  # per data-parallel rank


def group_layouts(family: str) -> list[Layout]:
    """The layouts of one group's 2 ranks the trainer accepts with fault tolerance on."""
    moe = family.startswith("moe")
    base = build_config([*TINY, *FAMILIES[family], *FT])
    accepted = []
    for layout in enumerate_layouts(GROUP_RANKS, grad_accum=(1,), with_cp=True, with_ep=moe):
        if moe and layout.ep == 1 and layout.dp_shard * layout.tp > 1:
            continue  # MoE layouts shard the experts with EP
        try:
            cfg = apply_layout(base, layout, ROWS * layout.dp_shard)
            cfg.validate()
            preflight.check(cfg, GROUP_RANKS, GROUP_RANKS)
        except ConfigError:
            continue
        accepted.append(layout)
    return accepted


CASES = [(family, lay) for family in FAMILIES for lay in group_layouts(family)]
CI_CASES = {("dense", "ws2-tp2")}


def _cells(family: str, layout: Layout) -> list[str]:
    """The cover cells (tests/coverage_spec.py) of a case: replica groups, and the family (LoRA)
    under the group's layout; the CI case meets the groups with that layout inside too."""
    name = "qwen3_moe" if family.startswith("moe") else "llama3"
    inside = layout_cells(name, layout, feature="lora" if family == "lora" else None)
    if (family, layout.name) in CI_CASES:
        inside += [c.replace(f"{name}×", "ft-groups×") for c in inside if c.startswith(name)]
    return ["ft-groups×dp_replicate", *inside]


def _params():
    for family, lay in CASES:
        skip = not PARITY_FULL and (family, lay.name) not in CI_CASES
        marks = [pytest.mark.cover(*_cells(family, lay))]
        marks += [pytest.mark.skip(reason="make test-full")] if skip else []
        yield pytest.param(family, lay, id=f"{family}-{lay.name}", marks=marks)


def test_the_generated_cases_hold_every_parallelism_inside_a_group():
    dims = {d for _, lay in CASES for d in ("dp_shard", "tp", "cp", "ep") if getattr(lay, d) > 1}
    assert dims == {"dp_shard", "tp", "cp", "ep"}, CASES
    assert all(lay.dp_replicate == 1 and lay.pp == 1 for _, lay in CASES)
    assert {(family, lay.name) for family, lay in CASES} >= CI_CASES


@pytest.mark.parametrize("family, layout", list(_params()))
def test_without_a_fault_two_groups_train_like_plain_hsdp_and_resume_exactly(
    family, layout, tiny_dataset, tmp_path
):
    """2 groups of `layout` against plain HSDP (dp_replicate 2 × `layout`): 5 steps, then the
    whole job stopped and launched again to step 8, each group from its own checkpoint; every
    step's loss equal within 1e-5 (a constant learning rate, so that the schedule does not
    depend on training.steps), and the validation loss (every group's share of the held-out
    split, summed over the groups)."""
    rows = ROWS * layout.dp_shard
    inside = (*FAMILIES[family], *layout.overrides(rows))
    val = ["--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "1"]
    ft = [*FT, *CONSTANT_LR, "--checkpoint.interval", "5", *val]
    dump = str(tmp_path / "ft")
    late = late_group(1, 5)  # group 1 starts 5 s after group 0, at each launch
    out = finish(titanlab_train(ft_args(tiny_dataset, dump, 5, *ft, layout=inside), late), dump)
    assert "[g0rank0]:" in out and "[g1rank0]:" in out
    assert "recovered step" not in out, out[-3000:]  # no group was ever behind
    out = finish(titanlab_train(ft_args(tiny_dataset, dump, 8, *ft, layout=inside), late), dump)
    assert "loaded" in out, out[-3000:]
    hsdp = str(tmp_path / "hsdp")
    replicated = ("--parallelism.data_parallel_replicate_degree", "2",
                  "--training.global_batch_size", str(2 * rows))  # fmt: skip
    launch(2 * GROUP_RANKS, ft_args(tiny_dataset, hsdp, 8, *CONSTANT_LR, *val,
                                    layout=(*inside, *replicated))).check()  # fmt: skip
    want = read_metrics(hsdp)
    want_val = {
        s: rec["val_loss"] for s, rec in group_metrics_of(hsdp).items() if "val_loss" in rec
    }
    assert sorted(want_val) == [4, 8]
    for group in (0, 1):
        got = group_metrics(dump, group)
        assert sorted(got) == list(range(1, 9))
        assert all(rec["ft/groups"] == 2 for rec in got.values())
        worst = max(abs(got[s]["loss"] - want[s]) for s in want)
        print(f"{family} {layout.name}, group {group}: worst |Δloss| against HSDP {worst:.2e}")
        assert worst <= 1e-5, (group, {s: got[s]["loss"] for s in got}, want)
        assert all(abs(got[s]["val_loss"] - want_val[s]) <= 1e-5 for s in want_val), (got, want_val)
