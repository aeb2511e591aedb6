"""Dry runs (comm.mode fake_backend): every shipped config at the world size it states, the
published flavors at the layouts the planner picked, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from titanlab.config.manager import build_config
from titanlab.distributed.init import destroy_distributed
from titanlab.models.registry import FAMILIES, get_family
from titanlab.planning.cluster import PROFILES
from titanlab.trainer import Trainer, dry_run

from tests.unit.trainer.imported_stand_ins import imported_folder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
CONFIGS = sorted(
    os.path.basename(p) for p in glob.glob(os.path.join(REPO, "train_configs", "*.toml"))
)
PICKS = os.path.join(REPO, "docs", "dry_run_picks.json")
H100 = PROFILES["h100"].memory_bytes
PARITY_FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"


def llama3_8b_128k():
    """Llama 3.1 8B as `convert_checkpoint from-hf` imports it (its 128,256-id vocabulary)."""
    return dataclasses.replace(get_family("llama3").flavors["8B"], vocab_size=128256)


def stand_ins(config: str, tmp) -> list[str]:
    """What a config's header tells the user to make before launching (imports, a tokenizer,
    prepared data), as options: imported folders holding only the index of their weights, the
    bundled tokenizer, the default corpus. The dry run reads no weight and no data."""
    llama = get_family("llama3").flavors
    if config in ("llama3_8b_lora.toml", "llama3_8b_qlora.toml"):
        base = imported_folder(str(tmp / "llama3_8b_hf_dcp"), llama3_8b_128k())
        return ["--checkpoint.initial_load_path", base, "--model.tokenizer_path", "",
                "--data.dataset_path", ""]  # fmt: skip
    if config == "llama3_3b_distill_8b.toml":
        student = dataclasses.replace(llama["3B"], vocab_size=128256)
        return ["--checkpoint.initial_load_path", imported_folder(str(tmp / "3b"), student),
                "--distill.teacher_path", imported_folder(str(tmp / "8b"), llama3_8b_128k()),
                "--model.tokenizer_path", ""]  # fmt: skip
    if config == "qlora_debug.toml":
        # the base tests/integration/test_qlora_training.py imports: every weight in whole NF4 blocks
        base = dataclasses.replace(llama["debugmodel"], n_layers=2, hidden_dim=768, vocab_size=4352)
        return ["--checkpoint.initial_load_path", imported_folder(str(tmp / "base"), base)]
    return []


def built(argv: list[str]):
    """(rank 0's bytes, the report, the trainer) of a dry run of `argv`; the fake process group
    is ended afterwards."""
    try:
        trainer = Trainer(build_config(argv))
        held = dry_run.rank_bytes(trainer)
        return held, dry_run.report(trainer, held), trainer
    finally:
        destroy_distributed(barrier=False)


@pytest.fixture(autouse=True)
def no_ngpu(monkeypatch, tmp_path):
    monkeypatch.delenv("NGPU", raising=False)
    monkeypatch.chdir(tmp_path)  # a config's relative dump folder, never written anyway


@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_dry_runs_at_the_world_size_it_states(config, tmp_path):
    path = os.path.join(REPO, "train_configs", config)
    held, text, trainer = built(["--job.config_file", path, "--comm.mode", "fake_backend",
                                 *stand_ins(config, tmp_path)])  # fmt: skip
    world = trainer.config.comm.fake_world_size
    assert world >= 2 and trainer.parallel_dims.world_size == world
    print(f"{config} on {world}: {text}")
    assert text.endswith("dry run: ok, nothing trained or written")
    assert trainer.memory.total <= H100  # the pre-flight's estimate fits the GPU it is sized for
    # AdamW: two fp32 moments per trained parameter (and a step count each)
    trained = [p for part in trainer.model_parts for p in part.parameters() if p.requires_grad]
    assert 2 * held.grads <= held.optimizer <= 2 * held.grads + 8 * len(trained)
    assert_parameters_even_and_estimated(held, trainer)
    # the save plan holds rank 0's model and optimizer shards
    assert held.save_bytes >= held.params + held.optimizer - 8 * len(trained)


def assert_parameters_even_and_estimated(held, trainer) -> None:
    """Without pipeline stages or adapters, rank 0's fp32 parameters are the even share of the
    dp_shard × cp × tp ranks FSDP shards them over (a tensor's shard is at most one row longer;
    expert weights too: `titanlab.distributed.expert_sharding`), of dp_shard × cp for those
    tensor parallel keeps whole (norms, routers, shared experts, MLA's wkv_a), and what the
    pre-flight's estimate counts, both within 1%."""
    dims = trainer.parallel_dims
    if dims.pp_enabled or trainer.config.peft.method != "none":
        return
    from titanlab.components.builders import build_meta_model
    from titanlab.models.common.counting import count_params
    from titanlab.planning.meta_counts import tp_whole_params

    model = build_meta_model(trainer.model_args)
    total = count_params(model)
    whole = tp_whole_params(model) if dims.tp > 1 else 0
    even = (total - whole) / (dims.dp_shard * dims.cp * dims.tp) + whole / (dims.dp_shard * dims.cp)
    assert held.params == pytest.approx(4 * even, rel=0.01)
    assert held.params == pytest.approx(trainer.memory.params, rel=0.01)


def recorded_picks() -> list[tuple[str, dict]]:
    with open(PICKS, encoding="utf-8") as f:
        return sorted(json.load(f).items())


def pick_features(name: str, pick: dict) -> set[str]:
    """What a pick exercises: its family, each parallelism of its layout (`ws16-hsdp2x4-tp2-ep8`
    → hsdp, tp, ep; the pipeline schedule by name) and its AC mode."""
    layout = {re.sub(r"\d+(x\d+)?$", "", part) for part in pick["layout"].split("-")[1:]}
    return {f"family {name.split()[0]}", f"ac {pick['ac']}"} | {f"layout {p}" for p in layout}


def ci_picks() -> list[tuple[str, dict]]:
    """Every recorded pick under TITANLAB_PARITY_FULL=1 (make test-full); in CI, picks in which
    every family, parallelism, pipeline schedule and AC mode of the recorded picks appears at
    least once: a greedy weighted set cover, each pick weighed by its recorded planning seconds
    (a Qwen3.5 pick, whose linear-attention blocks trace per chunk, costs ~5× a Llama one).
    Every shipped config still dry-runs at its real size above (405B, 671B included)."""
    picks = dict(recorded_picks())
    if PARITY_FULL:
        return sorted(picks.items())
    features = {name: pick_features(name, pick) for name, pick in picks.items()}
    wanted, chosen = set().union(*features.values()), []
    while wanted:
        best = max(
            features,
            key=lambda n: (
                len(features[n] & wanted) / picks[n]["planned_s"],
                -picks[n]["planned_s"],
            ),
        )
        chosen.append(best)
        wanted -= features[best]
    return sorted((name, picks[name]) for name in chosen)


def test_the_ci_picks_cover_every_family_parallelism_and_ac_mode():
    every = set().union(*(pick_features(n, p) for n, p in recorded_picks()))
    chosen = set().union(*(pick_features(n, p) for n, p in ci_picks()))
    assert chosen == every
    assert {"layout hsdp", "layout ZBVZeroBubble", "family qwen3_5_moe", "ac full"} <= every


def test_every_published_flavor_has_a_recorded_pick():
    """`tools/dry_run_flavors.py` planned every registered family's published flavors (not
    the debug ones) and recorded the planner's first pick in docs/dry_run_picks.json."""
    recorded = {name for name, _ in recorded_picks()}
    published = {
        f"{family} {flavor}"
        for family in FAMILIES  # every registered family
        for flavor in get_family(family).flavors
        if not flavor.startswith("debugmodel")
    }
    assert published <= recorded


@pytest.mark.parametrize(
    ("name", "pick"), ci_picks(), ids=[n.replace(" ", "-") for n, _ in ci_picks()]
)
def test_every_published_flavor_dry_runs_at_the_layout_the_planner_picked(name, pick):
    """Every recorded pick in make test-full; CI's cover of them (`ci_picks`)."""
    family, flavor = name.split(" ")
    path = os.path.join(REPO, pick["config"])
    held, text, trainer = built(["--job.config_file", path, "--model.name", family,
                                 "--model.flavor", flavor, "--comm.mode", "fake_backend",
                                 "--comm.fake_world_size", str(pick["world_size"]),
                                 *pick["args"]])  # fmt: skip
    print(f"{name}: {text}")
    assert trainer.parallel_dims.world_size == pick["world_size"]
    assert trainer.memory.total <= H100
    assert held.params > 0 and 2 * held.grads <= held.optimizer
    assert_parameters_even_and_estimated(held, trainer)


def test_fewer_local_experts_than_expert_fsdp_ranks_hold_the_even_share():
    """Qwen3-MoE 235B-A22B at EP 16 on 256 ranks (full AC): 8 local experts over 16 efsdp
    ranks, which FSDP's default dim-0 sharding padded to a whole expert each (1.97× the even
    share on rank 0)."""
    config = os.path.join(REPO, "train_configs", "qwen3_30b_a3b.toml")
    held, text, trainer = built(["--job.config_file", config, "--model.flavor", "235B-A22B",
                                 "--comm.mode", "fake_backend", "--comm.fake_world_size", "256",
                                 "--parallelism.data_parallel_shard_degree", "256",
                                 "--parallelism.expert_parallel_degree", "16",
                                 "--activation_checkpoint.mode", "full"])  # fmt: skip
    print(text)
    assert trainer.parallel_dims.ep == 16 and trainer.parallel_dims.world_size == 256
    assert_parameters_even_and_estimated(held, trainer)


def test_experts_without_expert_parallel_over_more_fsdp_ranks_hold_the_even_share():
    """The debug Qwen3-MoE on 16 FSDP ranks without EP: its 8 experts ride in their blocks'
    units over 16 ranks, which FSDP's default dim-0 sharding padded to a whole expert each
    (1.54× the even share of the whole model on rank 0 before)."""
    config = os.path.join(REPO, "train_configs", "qwen3_moe_debug.toml")
    held, text, trainer = built(["--job.config_file", config, "--comm.mode", "fake_backend",
                                 "--comm.fake_world_size", "16",
                                 "--parallelism.data_parallel_shard_degree", "16",
                                 "--parallelism.expert_parallel_degree", "1"])  # fmt: skip
    print(text)
    assert trainer.parallel_dims.ep == 1 and trainer.parallel_dims.dp_shard == 16
    assert_parameters_even_and_estimated(held, trainer)


def run_train(*args: str, ngpu: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NGPU"}
    env["PYTHON"] = sys.executable
    if ngpu:
        env["NGPU"] = ngpu
    return subprocess.run([os.path.join(REPO, "run_train.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


def test_deepseek_v3_671b_on_256_gpus_builds_plans_and_exits_0_through_run_train():
    """The issue's command: 671B with PP 8 × EP 32 on 256 ranks, one process on this CPU."""
    out = run_train("train_configs/deepseek_v3_debug.toml", "--model.flavor", "671B",
                    "--comm.mode", "fake_backend", "--parallelism.pipeline_parallel_degree", "8",
                    "--parallelism.expert_parallel_degree", "32", ngpu="256")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "world size 256 on fake process groups, planned for h100 (79.6 GiB each)" in out.stdout
    assert "dry run: ok" in out.stdout.splitlines()[-1]
    estimate = next(line for line in out.stdout.splitlines() if "memory estimate" in line)
    assert float(estimate.split("estimate (peak rank): ")[1].split(" GiB")[0]) <= 79.6


def test_a_config_that_does_not_fit_its_target_gpu_stops_with_one_line():
    out = run_train("train_configs/llama_405b.toml", "--comm.mode", "fake_backend", ngpu="8")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("titanlab: error: model.flavor=405B")
    assert "GiB on each h100 (comm.dry_run_device)" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_deepseek_v3_671b_on_two_cpu_processes_is_refused_with_one_line():
    """The pre-flight of a real launch: the shortened-model tracer ran into DeepSeek-V3's dense
    first blocks and raised a traceback before."""
    out = subprocess.run(
        [sys.executable, "-m", "titanlab.preflight", "--nproc", "2", "--job.config_file",
         os.path.join(REPO, "train_configs", "deepseek_v3_debug.toml"), "--model.flavor", "671B"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titanlab: error: model.flavor=671B needs about")
    assert "GiB per rank" in lines[0]


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ([], {}, "set NGPU=<ranks> or --comm.fake_world_size <ranks>"),
        ([], {"NGPU": "many"}, "NGPU='many' must be a whole number >= 1"),
        (["--comm.dry_run_device", "tpu9"], {"NGPU": "8"}, "cluster profile 'tpu9' is not known"),
        (["--float8.enable", "--comm.dry_run_device", "a100"], {"NGPU": "8"},
         "comm.dry_run_device=a100 (a100) has none"),
        (["--comm.mode", "fake"], {}, "comm.mode='fake' is not one of default, fake_backend"),
    ],
)  # fmt: skip
def test_bad_dry_run_options_are_one_line(args, env, says):
    argv = ["--model.flavor", "8B", "--comm.mode", "fake_backend", *args]
    out = subprocess.run([sys.executable, "-m", "titanlab.train", *argv], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env={**os.environ, **env})  # fmt: skip
    assert out.returncode == 2, out.stdout[-1000:] + out.stderr[-1000:]
    last = (out.stdout + out.stderr).strip().splitlines()[-1]
    assert last.startswith("titanlab: error:") and says in last
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("config", "args", "says"),
    [
        ("debug_model.toml", [], "forward/backward: ran on fake tensors (a microbatch of 16 × 128"),
        # issue 64: compiled blocks ran Inductor's CPU kernels on fake tensors (segfault); the
        # shipped Llama 3 8B config as it is (compiled, seq 8192, 8 ranks). The other shipped
        # configs are make test-full's (test_every_shipped_config_runs_its_dry_run_step...).
        ("llama_8b.toml", [],
         "ran on fake tensors (a microbatch of 1 × 8192 tokens) (compiled regions run eagerly)"),
        ("debug_model.toml", ["--parallelism.tensor_parallel_degree", "2",
                              "--comm.fake_world_size", "4"], "ran on fake tensors"),
        ("qwen3_moe_debug.toml", [], "not run on fake tensors (DataDependentOutputException"),
        ("debug_model.toml", ["--parallelism.pipeline_parallel_degree", "2",
                              "--parallelism.pipeline_parallel_microbatch_size", "8"],
         "not run (pipeline schedules step on real stages only)"),
    ],
)  # fmt: skip
def test_a_dry_run_step_runs_forward_and_backward_on_fake_tensors_where_it_can(config, args, says):
    path = os.path.join(REPO, "train_configs", config)
    _, text, _ = built(["--job.config_file", path, "--comm.mode", "fake_backend",
                        "--comm.dry_run_step", *args])  # fmt: skip
    assert says in text and text.endswith("dry run: ok, nothing trained or written")


@pytest.mark.skipif(not PARITY_FULL, reason="make test-full runs it")
@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_runs_its_dry_run_step_or_says_why_not(config, tmp_path):
    """Issue 64: `--comm.dry_run_step` on every shipped config as it is (the compiled 8B ones
    included) runs forward and backward on fake tensors, or names in one line why not."""
    path = os.path.join(REPO, "train_configs", config)
    _, text, _ = built(["--job.config_file", path, "--comm.mode", "fake_backend",
                        "--comm.dry_run_step", *stand_ins(config, tmp_path)])  # fmt: skip
    step = next(line for line in text.splitlines() if line.startswith("forward/backward: "))
    print(f"{config}: {step}")
    assert "ran on fake tensors" in step or "not run" in step
    assert text.endswith("dry run: ok, nothing trained or written")
