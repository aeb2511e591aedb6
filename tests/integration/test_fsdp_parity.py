"""2-process FSDP2 trains to the same losses as 1 process on the same global batch."""

STEPS = 5


def assert_close(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    diffs = {s: abs(a[s] - b[s]) for s in a}
    assert max(diffs.values()) <= tol, diffs


def test_fsdp2_matches_single_process(train):
    # Global batch 4 samples: 1 process × local 4, and 2 FSDP ranks × local 2.
    single = train(1, "--training.steps", str(STEPS), "--training.local_batch_size", "4").check()
    fsdp = train(2, "--training.steps", str(STEPS), "--training.local_batch_size", "2").check()
    assert_close(single.losses, fsdp.losses, 1e-5)
    # The run trains: loss goes down over the 5 steps.
    assert single.losses[STEPS] < single.losses[1]


def test_gradient_accumulation_matches_single_process(train):
    # 2 ranks × local 1 × 2 accumulation steps = the same global batch of 4.
    single = train(1, "--training.steps", str(STEPS), "--training.local_batch_size", "4").check()
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
    assert_close(single.losses, accum.losses, 1e-5)
