"""A NaN/inf loss stops the run with the step and the last good checkpoint."""


def test_nan_loss_stops_with_step_and_checkpoint(train, tmp_path):
    # An absurd learning rate blows the weights up after a few updates.
    run = train(
        1,
        "--training.steps",
        "8",
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        "--checkpoint.export_at_end",
        "false",
        dump=str(tmp_path / "run"),
    )
    # The trainer exits with 3; torchrun reports the failed child and exits non-zero itself.
    assert run.returncode != 0 and "exitcode  : 3" in run.stderr, (
        run.stdout[-2000:] + run.stderr[-2000:]
    )
    line = [ln for ln in run.stderr.splitlines() if ln.startswith("titanlab: error: loss is")]
    assert len(line) == 1, run.stderr[-2000:]
    bad_step = max(run.losses) + 1
    assert f"at step {bad_step};" in line[0]
    assert (
        f"last complete checkpoint: {tmp_path / 'run' / 'checkpoint' / f'step-{bad_step - 1}'}"
        in line[0]
    )
