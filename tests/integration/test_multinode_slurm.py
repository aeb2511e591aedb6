"""`multinode_trainer.slurm`, submitted with sbatch to a real Slurm cluster of 2 nodes.

The cluster (tests/integration/slurm_cluster.py) needs root: it installs slurm-wlm and munge
when missing, creates network namespaces and edits /etc/hosts, so these tests run only when
TITANLAB_SLURM_TESTS=1 (`.ci/run` sets it).
"""

import os
import sys

import pytest

from conftest import CONSTANT_LR, REPO, TINY, launch, read_metrics, wait_for
from slurm_cluster import SlurmTestCluster
from titanlab.checkpoint import store

ENABLE = "TITANLAB_SLURM_TESTS"
pytestmark = [
    pytest.mark.skipif(
        os.environ.get(ENABLE) != "1",
        reason=f"needs a Slurm test cluster: run as root with {ENABLE}=1 (installs slurm-wlm "
        "and munge, creates network namespaces, edits /etc/hosts; all undone afterwards)",
    ),
    pytest.mark.serial,  # one cluster per machine: its daemons, namespaces and /etc/hosts
]
SCRIPT = os.path.join(REPO, "multinode_trainer.slurm")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm")), nodes=2, cpus_per_node=2)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def straight(tiny_dataset, tmp_path_factory):
    """Exact losses of an uninterrupted 12-step run of 2 ranks on one host (the reference)."""
    dump = str(tmp_path_factory.mktemp("straight"))
    launch(2, ["--job.config_file", TINY[1], *overrides(tiny_dataset, dump, 12)]).check()
    return read_metrics(dump)


def overrides(tiny_dataset, dump, steps):
    args = TINY[2:]  # the script passes --job.config_file itself
    return [
        *args,
        *CONSTANT_LR,
        "--data.dataset_path",
        tiny_dataset,
        "--job.dump_folder",
        dump,
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "100",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.export_at_end",
        "false",
    ]


def submit(slurm, dump, args, nodes=2, ntasks_per_node=1, env=None):
    """sbatch the project's script (`env`: more of its variables); returns the job id and the
    path of its log."""
    log = os.path.join(dump, "slurm-%j.out")
    os.makedirs(dump, exist_ok=True)
    env = {
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "PYTHON": sys.executable,
        "MAX_RESTARTS": "0",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    job = slurm.submit(
        SCRIPT,
        *args,
        cwd=REPO,
        env=env,
        sbatch_args=[
            f"--nodes={nodes}",
            f"--ntasks-per-node={ntasks_per_node}",
            "--cpus-per-task=1",
            f"--output={log}",
            "--time=10",
        ],
    )
    return job, log.replace("%j", str(job))


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.mark.cover("launch:slurm")
def test_sbatch_two_nodes_trains_checkpoints_and_second_submission_resumes(
    slurm, tiny_dataset, straight, tmp_path
):
    dump = str(tmp_path / "slurm_run")
    job, log = submit(slurm, dump, overrides(tiny_dataset, dump, 4))
    info = slurm.wait(job, timeout=300)
    text = read(log)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert info["NodeList"] == "n[1-2]"
    assert "world size 2 = 2 node(s) × 1 rank(s), backend gloo" in text, text[-4000:]
    ckpt = os.path.join(dump, "checkpoint", "step-4")
    assert store.incomplete_reason(ckpt) is None

    job2, log2 = submit(slurm, dump, overrides(tiny_dataset, dump, 8))
    info2 = slurm.wait(job2, timeout=300)
    text2 = read(log2)
    assert (info2["JobState"], info2["ExitCode"]) == ("COMPLETED", "0:0"), text2[-4000:]
    assert f"checkpoint: loaded {ckpt} (step 4)" in text2, text2[-4000:]
    assert "training: steps 5 → 8" in text2

    # The two submissions together equal one uninterrupted run of 2 ranks on one host.
    got = read_metrics(dump)
    assert [got[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]  # bitwise


def test_preempted_job_checkpoints_requeues_itself_and_resumes_exactly(
    slurm, tiny_dataset, straight, tmp_path
):
    dump = str(tmp_path / "preempted")
    job, log = submit(slurm, dump, overrides(tiny_dataset, dump, 12))
    metrics = os.path.join(dump, "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and len(read(metrics).splitlines()) >= 3)
    slurm.signal(job, "USR1", batch=True)  # what --signal=B:USR1@180 sends before the time limit
    wait_for(lambda: requeued(slurm.job(job)))
    # Slurm holds a requeued job for about 2 minutes before it is eligible again; shorten that
    # wait, but not to zero: a job restarted in the second its old credential was revoked is
    # killed ("Job credential revoked").
    slurm.control("update", f"JobId={job}", "StartTime=now+5")
    info = slurm.wait(job, timeout=300)
    text = read(log)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        text[-4000:]
    )
    stopped = int(text.split("preempted after step ")[1].split(";")[0])
    assert 3 <= stopped < 12, text[-4000:]
    assert f"requeueing job {job}" in text
    assert f"checkpoint: loaded {dump}/checkpoint/step-{stopped} (step {stopped})" in text
    got = read_metrics(dump)
    assert [got[s] for s in range(1, 13)] == [straight[s] for s in range(1, 13)]  # bitwise


def requeued(info):
    return info.get("Restarts") == "1" and info.get("JobState") == "PENDING"


@pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-full: a third sbatch job"
)
@pytest.mark.cover("launch:slurm", "ft-groups×dp_replicate")
def test_ft_groups_split_the_nodes_into_replica_groups_that_train_like_one_run(
    slurm, tiny_dataset, straight, tmp_path
):
    """FT_GROUPS=2 on 2 nodes: the lighthouse on the first node and one srun per node's replica
    group (torchft, titanlab[ft]); both groups train every step together and their losses equal
    the 2-rank run on one host within 1e-5."""
    pytest.importorskip("torchft")
    dump = str(tmp_path / "ft_groups")
    env = {
        "FT_GROUPS": "2",
        "FT_MIN_REPLICAS": "2",  # both groups in every step
        "FT_LIGHTHOUSE_LOG": os.path.join(dump, "lighthouse.log"),
    }  # not in the checkout
    job, log = submit(slurm, dump, overrides(tiny_dataset, dump, 4), env=env)
    info = slurm.wait(job, timeout=300)
    text = read(log)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert "2 replica groups of 1 node(s), lighthouse http://n1:29510" in text, text[-4000:]
    for group in (0, 1):
        got = read_metrics(os.path.join(dump, f"replica_{group}"))
        assert sorted(got) == [1, 2, 3, 4]
        assert "groups: 2" in text
        assert max(abs(got[s] - straight[s]) for s in got) <= 1e-5, (got, straight)
