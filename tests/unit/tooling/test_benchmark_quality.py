"""tools/benchmark_quality.py: the curves it reads, the best rates, tokens and seconds to target."""

import json

from tools.benchmark_quality import Curve, best, read_curve, table, to_target


def write_run(path, val: dict[int, float], step_ms: float) -> None:
    """A metrics.jsonl with a record every 10 steps, validation at the given steps."""
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in range(10, 61, 10):
            rec = {"step": step, "steps_in_window": 10, "step_time_ms": step_ms,
                   "tokens_per_step": 4096, "loss": 5.0}  # fmt: skip
            if step in val:
                rec["val_loss"] = val[step]
            f.write(json.dumps(rec) + "\n")


def test_a_curve_sums_the_windows_step_times_and_keeps_the_validations(tmp_path):
    write_run(tmp_path, {30: 4.0, 60: 3.5}, step_ms=200.0)
    c = read_curve(str(tmp_path), "Muon", 4e-3)
    assert c.val == {30: 4.0, 60: 3.5} and c.final == 3.5
    assert c.seconds[30] == 6.0 and c.seconds[60] == 12.0


def test_tokens_and_seconds_to_the_target_are_at_the_first_validation_reaching_it():
    c = Curve("Muon", 1e-3, 1000, val={10: 4.0, 20: 3.4, 30: 3.2},
              seconds={10: 5.0, 20: 10.0, 30: 15.0})  # fmt: skip
    assert to_target(c, 3.5) == (20_000, 10.0)
    assert to_target(c, 3.2) == (30_000, 15.0)
    assert to_target(c, 3.0) is None


def test_the_best_rate_is_the_lowest_final_validation_and_the_table_gives_the_ratios():
    def curve(opt, lr, finals, ms):
        return Curve(opt, lr, 1000, val={10: 4.0, 20: finals[0], 30: finals[1]},
                     seconds={10: ms / 100, 20: ms / 50, 30: 3 * ms / 100}, step_ms=[ms])  # fmt: skip

    curves = [curve("AdamW", 1e-3, (3.8, 3.6), 100), curve("AdamW", 2e-3, (3.7, 3.5), 100),
              curve("Muon", 1e-3, (3.5, 3.3), 110), curve("Muon", 2e-3, (3.6, 3.4), 110)]  # fmt: skip
    assert best(curves, "AdamW").lr == 2e-3 and best(curves, "Muon").lr == 1e-3
    text = table(curves, "python tools/benchmark_quality.py")
    # AdamW reaches its 3.5 at step 30 (30,000 tokens, 3 s), Muon at step 20 (20,000, 2.2 s)
    assert "tokens 0.67×, seconds 0.73×, step time 1.10×" in text
    assert "| Muon | 0.001 | 3.3000 | 20,000 | 2 | 110 |" in text
