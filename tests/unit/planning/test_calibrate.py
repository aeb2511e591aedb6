"""A calibrated profile of this machine: measured rates a planner can use, and plans with it."""

import pytest

from titanlab.config.manager import build_config
from titanlab.planning import planner
from titanlab.planning.calibrate import calibrate
from titanlab.planning.cluster import load_profile, save_profile

pytestmark = pytest.mark.xdist_group("calibrate")

# One sample of 128 tokens per microbatch: the rates are measured at the job's own shapes, and
# what is checked here (each in its physical range, the planner ranking with them) does not
# depend on their size; at local batch 4 FSDP's timed triples made this fixture ~65 s of CI.
JOB = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "128",
       "--training.global_batch_size", "8", "--training.local_batch_size", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def profile():
    config = build_config(JOB)
    args = planner.model_args_of(config)
    return config, args, calibrate(config, args, 2)


def test_the_measured_rates_are_physical(profile, tmp_path):
    _, _, cpu = profile
    e = cpu.efficiency
    assert cpu.device_type == "cpu" and cpu.devices_per_node == 2 and cpu.shared_cores >= 1
    assert 1e8 < cpu.peak_flops["float32"] < 1e13  # one core: 0.1 GFLOP/s .. 10 TFLOP/s
    assert 0 < e.attention <= 1 and e.pointwise >= 0 and e.matmul == e.optimizer == e.link == 1
    assert 1e8 < cpu.memory_bandwidth < 1e12 and cpu.intra_bandwidth > 1e6
    assert 0 < cpu.intra_latency < 0.1
    # torch's split backward: an autograd call per parameter group (9 in a Llama block)
    assert 0 < cpu.split_backward_s < 0.05
    assert 0 <= cpu.tp_block_s < 1.0  # DTensor's dispatch of a TP block, on top of its FLOPs
    # FSDP2's flat-buffer copies per collective of a debug-model unit
    assert 0 <= cpu.fsdp_gather_s < 0.1 and 0 <= cpu.fsdp_reduce_s < 0.1
    path = str(tmp_path / "cpu.json")
    save_profile(cpu, path)
    assert load_profile(path) == cpu


def test_the_planner_ranks_cpu_layouts_with_it(profile):
    """On a CPU profile the candidates are validated for CPU and planned in float32."""
    config, args, cpu = profile
    ranked = planner.plan(config, args, cpu)
    fitting = [c for c in ranked if c.fits]
    assert fitting and all(c.layout.world_size == 2 for c in ranked)
    run = planner.run_of(config, "cpu")
    assert run.dtype == "float32" and run.param_bytes == 4
    best = fitting[0].prediction
    overheads = best.split_backward_s + best.tp_overhead_s + best.fsdp_overhead_s
    assert best.step_s == pytest.approx(
        best.compute_s + best.bubble_s + best.optimizer_s + overheads + best.exposed_comm_s
    )
