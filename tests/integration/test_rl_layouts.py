"""GRPO, PPO and DPO, one update on fixed data (prompts of different lengths), equals one process
under every 2-rank layout the trainer accepts for it, LoRA included, on every family (make
test-full; CI meets each algorithm, LoRA, each kind of model and DDP once), on every 4-rank layout
(HSDP included; make test-full), and with its log-probabilities from the fused head (GRPO in CI).
The learning curves and resumes are tests/integration/test_rl.py's."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from conftest import REPO, launch_command
from tests.coverage_spec import DIMS
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning import preflight
from titanlab.planning.layouts import apply_layout, enumerate_layouts
from tools.lib.rank_pool import default_pool

CONFIG = os.path.join(REPO, "train_configs", "grpo_debug.toml")
DPO_CONFIG = os.path.join(REPO, "train_configs", "dpo_debug.toml")
PPO_CONFIG = os.path.join(REPO, "train_configs", "ppo_debug.toml")
QUIET = ["--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "120",
         "--debug.deterministic", "true"]  # fmt: skip
GLOBAL_BATCH = 16  # completions: 4 prompts × group_size 4

# Adam's update g / (sqrt(v) + eps) moves a weight by up to lr · δ / eps for a gradient
# difference δ (largest where g ≈ 0, as in LoRA's B at its zero start): eps 1e-5 keeps the
# reduction-order differences of another layout (δ ~ 1e-8) far below the parameter bound.
FIXED = [*QUIET, "--checkpoint.enable", "false", "--optimizer.eps", "1e-5"]
GRPO_FIXED = ["--rl.group_size", "4", "--rl.iterations", "2", "--rl.beta", "0.04"]
FAMILIES = {"llama3": "debugmodel_tiny", "qwen3": "debugmodel_deep", "qwen3_moe": "debugmodel_deep"}


def torchrun(nproc: int, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = launch_command(nproc, args)
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def layouts(family: str, algorithm: str, world: int = 2) -> tuple[list, list[str]]:
    """The layouts of `world` ranks the trainer accepts for a run of `algorithm` on `family`
    (asked of the same pre-flight the trainer runs), and the one-line refusals of the others."""
    base = build_config(fixed_args(family, algorithm))
    accepted, refused = [], []
    moe = family == "qwen3_moe"
    for layout in enumerate_layouts(world, grad_accum=(1,), with_ep=moe):
        if moe and layout.ep == 1 and layout.pp == 1 and layout.dp_shard * layout.tp > 1:
            continue  # MoE layouts shard the experts with EP (refused otherwise, tested elsewhere)
        try:
            cfg = apply_layout(base, layout, GLOBAL_BATCH)
            cfg.validate()
            preflight.check(cfg, world, world)
        except ConfigError as e:
            refused.append(f"{layout.name}: {e}")
            continue
        accepted.append(layout)
    return accepted, refused


LORA = ["--peft.method", "lora", "--peft.rank", "4", "--peft.alpha", "8"]
FUSED = ["--loss.fused_linear_cross_entropy", "true", "--loss.chunk_size", "24"]
PLAIN = ["--loss.fused_linear_cross_entropy", "false"]


def fixed_args(family: str, algorithm: str) -> list[str]:
    """A run of `algorithm` (grpo, ppo, dpo; `-lora`: training LoRA adapters, the reference
    being the base with adapters off) on a tiny model of `family`."""
    base, _, option = algorithm.partition("-")
    config, extra = {"grpo": (CONFIG, GRPO_FIXED), "ppo": (PPO_CONFIG, GRPO_FIXED),
                     "dpo": (DPO_CONFIG, [])}[base]  # fmt: skip
    extra = [*extra, *{"": PLAIN, "lora": [*PLAIN, *LORA], "fused": FUSED}[option]]
    return ["--job.config_file", config, *FIXED, *extra, "--model.name", family,
            "--model.flavor", FAMILIES[family]]  # fmt: skip


def fixed_step(tmp_path, family: str, algorithm: str, layout=None) -> dict:
    out = str(tmp_path / f"{algorithm}-{family}-{layout.name if layout else 'single'}.pt")
    args = [*fixed_args(family, algorithm), "--job.dump_folder", str(tmp_path / "dump")]
    args += layout.overrides(GLOBAL_BATCH) if layout else ["--training.local_batch_size",
                                                            str(GLOBAL_BATCH)]  # fmt: skip
    here = os.path.join(REPO, "tests", "integration")
    nproc = layout.world_size if layout else 1
    if os.environ.get("TITANLAB_WARM_RANKS", "1") == "0":
        torchrun(nproc, [os.path.join(here, "rl_fixed_step.py"), out, *args])
    else:  # numerics only: the warm ranks (the launcher's own tests start torchrun)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        run = default_pool().run(nproc, [out, *args], env=env, timeout=300,
                                 target="rl_fixed_step:pool_main", paths=[here])  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return torch.load(out, weights_only=True)


FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
FULL_ONLY = pytest.mark.skipif(not FULL, reason="make test-parity-full runs it")


# CI meets each algorithm, LoRA, and each kind of model (dense, MoE with EP) once, DDP with the
# dense one; make test-parity-full runs every family × algorithm on every layout.
CI_CASES = {("qwen3_moe", "grpo"), ("llama3", "ppo"), ("qwen3", "dpo-lora")}
CI_DDP = ("llama3", "ppo")
LAYOUT_DIMS = {"llama3": ("dp_replicate", "dp_shard", "tp"), "qwen3": ("dp_replicate", "dp_shard",
               "tp"), "qwen3_moe": ("dp_replicate", "dp_shard", "tp", "ep")}  # fmt: skip
"""The dimensions of each family's accepted 2-rank layouts (the test checks the layouts)."""


def _cells(family: str, algorithm: str) -> list[str]:
    """The cover cells (tests/coverage_spec.py) of a case: RL (and LoRA) under the dimensions of
    the layouts it runs (CI leaves DDP to one case)."""
    ci = (family, algorithm) in CI_CASES
    dims = [d for d in LAYOUT_DIMS[family]
            if d != "dp_replicate" or not ci or (family, algorithm) == CI_DDP]  # fmt: skip
    features = ["rl", "lora"] if algorithm.endswith("-lora") else ["rl"]
    return [f"{f}×{d}" for f in features for d in dims]


CASES = [
    pytest.param(
        family,
        algorithm,
        marks=(
            pytest.mark.cover(*_cells(family, algorithm)),
            *(() if (family, algorithm) in CI_CASES else (FULL_ONLY,)),
        ),
    )
    for family in FAMILIES
    for algorithm in ("grpo", "ppo", "dpo", "grpo-lora", "dpo-lora")
]
assert set(LAYOUT_DIMS) == set(FAMILIES) and {d for v in LAYOUT_DIMS.values() for d in v} <= set(
    DIMS
)


@pytest.mark.parametrize(("family", "algorithm"), CASES)
def test_one_update_on_fixed_data_equals_one_process_on_every_layout(tmp_path, family, algorithm):
    accepted, refused = layouts(family, algorithm)
    names = sorted(layout.name for layout in accepted)
    print(f"\n{family}: layouts {names}; refused {len(refused)}")
    assert all("\n" not in r and ("pipeline" in r or "context" in r) for r in refused), refused
    expected = {"llama3": ["ws2-ddp2", "ws2-fsdp2", "ws2-tp2"], "qwen3": ["ws2-ddp2",
                "ws2-fsdp2", "ws2-tp2"], "qwen3_moe": ["ws2-ddp2", "ws2-fsdp2-ep2", "ws2-tp2-ep2"]}  # fmt: skip
    assert names == expected[family]
    single = fixed_step(tmp_path, family, algorithm)
    if not FULL and (family, algorithm) != CI_DDP:  # DDP: the plainest layout, once in CI
        accepted = [layout for layout in accepted if layout.dp_kind != "ddp"]
    assert_layouts_match(tmp_path, family, algorithm, accepted, single)


@FULL_ONLY
@pytest.mark.cover("rl×dp_replicate", "rl×dp_shard", "rl×tp")
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "dpo"])
def test_one_update_equals_one_process_on_every_4_rank_layout_hsdp_included(tmp_path, algorithm):
    """The same on 4 ranks (one group of completions, or 4 pairs, per dp rank): HSDP 2 × 2,
    FSDP 2 × TP 2, TP 4, ... (every layout the trainer accepts)."""
    accepted, refused = layouts("llama3", algorithm, world=4)
    names = sorted(layout.name for layout in accepted)
    print(f"\nllama3 {algorithm} on 4 ranks: layouts {names}; refused {len(refused)}")
    assert "ws4-hsdp2x2" in names and all("\n" not in r for r in refused)
    single = fixed_step(tmp_path, "llama3", algorithm)
    assert_layouts_match(tmp_path, "llama3", algorithm, accepted, single)


@pytest.mark.cover("rl-fused-head×dp_shard")
@pytest.mark.parametrize(
    "algorithm",
    ["grpo", pytest.param("ppo", marks=FULL_ONLY), pytest.param("dpo", marks=FULL_ONLY)],
)
def test_log_probabilities_from_the_fused_head_give_the_plain_heads_update(tmp_path, algorithm):
    """`loss.fused_linear_cross_entropy`: the objectives' log-probabilities come from the head
    chunk by chunk (backward recomputes each chunk's logits); one update on 1 process and on
    FSDP 2 equals the plain head's on 1 process."""
    plain = fixed_step(tmp_path, "llama3", algorithm)
    fsdp = next(lay for lay in layouts("llama3", algorithm)[0] if lay.name == "ws2-fsdp2")
    for layout in (None, fsdp):
        got = fixed_step(tmp_path, "llama3", f"{algorithm}-fused", layout)
        print(f"\n{algorithm} fused {layout.name if layout else '1 process'}: loss "
              f"{got['loss']:.8f} vs plain {plain['loss']:.8f}")  # fmt: skip
        assert got["loss"] == pytest.approx(plain["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(plain["grad_norm"], abs=1e-5)


def assert_layouts_match(tmp_path, family: str, algorithm: str, accepted: list, single: dict):
    for layout in accepted:
        got = fixed_step(tmp_path, family, algorithm, layout)
        diff = max((got["params"][k] - v).abs().max().item() for k, v in single["params"].items())
        print(f"{algorithm} {family} {layout.name}: loss {got['loss']:.8f} vs {single['loss']:.8f}, grad_norm "
              f"{got['grad_norm']:.6f} vs {single['grad_norm']:.6f}, max |Δparam| {diff:.2e}")  # fmt: skip
        assert got["loss"] == pytest.approx(single["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(single["grad_norm"], abs=1e-5)
        # A wrong gradient flips Adam's near-sign update (2 · lr = 6e-3); the bound is 1% of lr
        # (measured with eps 1e-5: at most 4.5e-7 over every family, algorithm and layout).
        assert diff < 0.01 * 3e-3
