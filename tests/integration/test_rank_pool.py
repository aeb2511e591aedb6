"""The warm-rank pool (`tools.lib.rank_pool`) that runs the integration tests' launches: a rank
that crashes or hangs is reported as that job's failure with the rank's last line, the next job
on the pool passes, a job leaves nothing behind that the next one sees, and DTensor's sharding
cache serves a later job's equal mesh with that job's own process groups."""

import os

import pytest

from tools.lib.rank_pool import PoolTimeout, RankPool

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def pool():
    pool = RankPool()
    yield pool
    pool.close()


def probe(pool: RankPool, name: str, nproc: int = 2, timeout: float = 60, args=(), **options):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return pool.run(nproc, list(args), env=env, timeout=timeout, target=f"pool_probes:{name}",
                    paths=[HERE], **options)  # fmt: skip


def assert_next_job_passes(pool: RankPool) -> None:
    proc = probe(pool, "report_state")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("sum=3") == 2  # both ranks took part in the all-reduce


def test_a_crashed_rank_fails_its_job_with_its_last_line_and_the_next_job_passes(pool):
    proc = probe(pool, "crash_rank_1")
    assert proc.returncode != 0
    assert "rank 1 exitcode : -11\n" in proc.stderr, proc.stderr
    assert "rank 1 last line: rank 1 about to fail\n" in proc.stderr, proc.stderr
    started = pool.started
    assert_next_job_passes(pool)
    assert pool.started > started  # the crashed rank's worker was replaced


def test_a_hung_rank_times_out_naming_its_last_line_and_the_next_job_passes(pool):
    with pytest.raises(PoolTimeout) as failure:
        probe(pool, "hang_rank_1", timeout=5)
    assert "rank 1: rank 1 is stuck here" in str(failure.value)
    assert "rank 0 started" in failure.value.output
    assert_next_job_passes(pool)


def test_a_job_leaves_nothing_behind_for_the_next(pool):
    before = probe(pool, "report_state")
    assert before.returncode == 0, before.stderr
    started = pool.started
    assert probe(pool, "dirty_the_process").returncode == 0
    after = probe(pool, "report_state")
    assert pool.started == started  # the same two workers ran all three jobs
    assert after.stdout == before.stdout
    assert "deterministic=False dtype=torch.float32" in after.stdout
    assert "env=None" in after.stdout and "sum=3" in after.stdout


def test_log_rank_keeps_one_ranks_stdout_and_every_ranks_stderr(pool):
    """As run_train.sh shows rank 0's output (torchrun's --local-ranks-filter): `log_rank=0`
    keeps rank 0's stdout only; a failure's stderr still names every failed rank."""
    both = probe(pool, "report_state")
    one = probe(pool, "report_state", log_rank=0)
    assert both.stdout.count("sum=3") == 2 and one.stdout.count("sum=3") == 1
    crashed = probe(pool, "crash_rank_1", log_rank=0)
    assert "rank 1 about to fail" not in crashed.stdout
    assert "rank 1 last line: rank 1 about to fail\n" in crashed.stderr, crashed.stderr


def test_a_later_jobs_equal_mesh_hits_the_sharding_cache_with_its_own_groups(pool):
    """The second job on the same workers with an equal mesh takes its ops' shardings from the
    first job's cache entries (no misses), their meshes aliased to its own: its all-reduces run on
    its own groups and give the first job's result; a job with another mesh in between changes
    nothing."""

    def run(name: str) -> list[dict[str, str]]:
        proc = probe(pool, "tensor_parallel_matmul", args=[name])
        assert proc.returncode == 0, proc.stderr
        return [dict(kv.split("=") for kv in line.split()) for line in proc.stdout.splitlines()]

    first, other, second = run("tp"), run("dp"), run("tp")
    assert len(first) == len(second) == 2
    assert {r["sum"] for r in first} == {r["sum"] for r in second} == {r["sum"] for r in other}
    assert len({r["sum"] for r in first}) == 1
    for before, after in zip(first, second):
        assert int(after["aliased"]) > int(before["aliased"])
        assert int(before["misses"]) > 0 and int(after["misses"]) == 0
