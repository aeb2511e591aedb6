"""metrics.jsonl and TensorBoard continue one curve across a resume: no step twice."""

import json

import pytest

from titanlab.metrics.sinks import JsonlSink, TensorBoardSink


def test_jsonl_keeps_steps_up_to_the_resumed_one_and_drops_a_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for s in (1, 2, 3, 4, 5):
            f.write(json.dumps({"step": s, "loss": 10.0 - s}) + "\n")
        f.write('{"step": 6, "lo')  # killed mid-write
    sink = JsonlSink(str(path), start_step=3)
    sink.write({"step": 4, "loss": 0.5})
    sink.close()
    recs = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]


def test_jsonl_new_run_starts_a_new_curve(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    JsonlSink(str(path), start_step=0).close()
    assert path.read_text() == ""


def test_tensorboard_resume_purges_the_steps_written_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    first = TensorBoardSink(tb, start_step=0)
    for s in range(1, 7):
        first.write({"step": s, "loss": float(s), "tag": "not a number"})
    first.close()
    again = TensorBoardSink(tb, start_step=4)  # resumed from the step-4 checkpoint
    for s in range(5, 9):
        again.write({"step": s, "loss": 100.0 + s})
    again.close()
    acc = EventAccumulator(tb)
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0),
                   (8, 108.0)]  # fmt: skip
