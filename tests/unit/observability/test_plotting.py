"""tools/plot_metrics: a valid PNG of the expected size whose curves are metrics.jsonl's values."""

import json
import os
import struct
import subprocess
import sys

import pytest

from titanlab.observability.plotting import DPI, HEIGHT_PX, PANELS, WIDTH_PX, plot_runs

pytest.importorskip("matplotlib")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def write_run(folder, scale: float, val_every: int = 0) -> list[dict]:
    os.makedirs(folder)
    recs = []
    for step in range(1, 11):
        rec = {"step": step, "loss": scale * 10 / step, "tps": 1000.0 + step,
               "memory_gib": 0.5 + step / 100, "grad_norm": scale / step}  # fmt: skip
        if val_every and step % val_every == 0:
            rec["val_loss"] = scale * 11 / step
        recs.append(rec)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_two_runs_overlaid_with_the_values_of_their_metrics(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    recs = {"run_a": write_run(a, 1.0, val_every=5), "run_b": write_run(b, 2.0)}
    out = tmp_path / "both.png"
    fig = plot_runs([str(a), str(b)], str(out))
    assert png_size(out) == (WIDTH_PX, HEIGHT_PX) and fig.dpi == DPI
    for ax, (key, _) in zip(fig.axes, PANELS):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for name, rs in recs.items():
            xy = lines[name].get_xydata().tolist()
            assert xy == [[r["step"], r[key]] for r in rs], (key, name)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "run_a" in labels and "run_b" in labels
    val = {line.get_label(): line for line in fig.axes[0].get_lines()}["run_a (val)"]
    assert val.get_xydata().tolist() == [[5, 11 / 5], [10, 11 / 10]]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tools.plot_metrics", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_writes_the_png_and_bad_input_is_one_line(tmp_path):
    write_run(tmp_path / "r", 1.0)
    proc = run_cli(str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "r" / "loss.png")
    assert png_size(tmp_path / "r" / "loss.png") == (WIDTH_PX, HEIGHT_PX)
    proc = run_cli(str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"plot_metrics: error: {tmp_path / 'missing' / 'metrics.jsonl'} does not exist; "
        "pass a run's dump folder (job.dump_folder)"
    ]
