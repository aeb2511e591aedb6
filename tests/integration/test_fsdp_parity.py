"""2-process FSDP2 trains to the same losses as 1 process on the same global batch, with
gradient accumulation; and the chunked fused linear + cross-entropy loss on FSDP 2, TP 2, CP 2
and PP 2."""

import pytest

STEPS = 5
_SINGLE: dict[str, dict[int, float]] = {}


def single_process(train) -> dict[int, float]:
    """The 1-process losses (global batch 4, the plain loss), run once for this module's tests."""
    if "losses" not in _SINGLE:
        run = train(1, "--training.steps", str(STEPS), "--training.local_batch_size", "4",
                    "--loss.fused_linear_cross_entropy", "false")  # fmt: skip
        _SINGLE["losses"] = run.check().losses
    return _SINGLE["losses"]


def assert_close(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    diffs = {s: abs(a[s] - b[s]) for s in a}
    assert max(diffs.values()) <= tol, diffs


def test_fsdp2_matches_single_process(train):
    # Global batch 4 samples: 1 process × local 4, and 2 FSDP ranks × local 2.
    single = single_process(train)
    fsdp = train(2, "--training.steps", str(STEPS), "--training.local_batch_size", "2").check()
    assert_close(single, fsdp.losses, 1e-5)
    # The run trains: loss goes down over the 5 steps.
    assert single[STEPS] < single[1]


@pytest.mark.parametrize(
    ("layout", "local"),
    [(["--parallelism.data_parallel_shard_degree", "2"], "2"),
     (["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
       "1"], "4"),
     (["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
       "1"], "4"),
     (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
       "1"], "4")],
    ids=["fsdp2", "tp2", "cp2", "pp2"],
)  # fmt: skip
def test_fused_linear_cross_entropy_matches_the_unfused_single_process(train, layout, local):
    """The output head and the loss fused over chunks of 100 tokens (the logits never whole),
    on 2 FSDP ranks, 2 TP ranks (the head split by vocabulary, its log-sum-exp all-reduced),
    2 CP ranks (each its sequence shard) or 2 pipeline stages (4 microbatches; the last stage's
    forward ends in the loss): the same losses as the plain head on 1 process, within 1e-5."""
    single = single_process(train)
    fused = train(2, "--training.steps", str(STEPS), "--training.local_batch_size", local,
                  "--loss.fused_linear_cross_entropy", "true", "--loss.chunk_size", "100",
                  *layout).check()  # fmt: skip
    print(f"\nfused {layout} vs plain 1 process: {fused.losses} vs {single}")
    assert_close(single, fused.losses, 1e-5)


def test_gradient_accumulation_matches_single_process(train):
    # 2 ranks × local 1 × 2 accumulation steps = the same global batch of 4.
    single = single_process(train)
    accum = train(
        2,
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "4",
    ).check()
    assert "grad_accum_steps=2" in accum.stdout
    assert_close(single, accum.losses, 1e-5)
