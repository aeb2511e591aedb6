"""tools/benchmark_torchtitan.py and tools/torchtitan_row.py without torchtitan: both stacks
are asked for the same work, the rows' figures, the report, the one-line refusals."""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

from titanlab.components.builders import build_model_args
from titanlab.config.manager import build_config
from tools.benchmark_torchtitan import (
    CPU_ROWS,
    CPU_SHAPE,
    GPU_ROWS,
    Row,
    compare,
    gpu_shape,
    merge,
    render,
    titanlab_cmd,
    torchtitan_cmd,
)
from tools.lib.runs import REPO
from tools.lib.torchtitan_cpu import CpuDevice
from tools.torchtitan_row import RandomTokens

GIB = 2**30


class _Args:
    steps, warmup, cpu, repeats, layers, torchtitan_version = 10, 4, True, 1, 0, "0.2.2"


def _flags(args: list[str]) -> dict[str, str]:
    """--key value / --key=value / --key / --no-key flags as a dict (bare flags: 'true')."""
    out, i = {}, 0
    while i < len(args):
        if args[i] == "--" or not args[i].startswith("--"):
            i += 1
            continue
        key = args[i][2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        else:
            parent, _, leaf = key.rpartition(".")
            value = "false" if leaf.startswith("no-") else "true"
            key = f"{parent}.{leaf[3:]}" if leaf.startswith("no-") else key
        out[key], i = value, i + 1
    return out


@pytest.mark.parametrize("row", GPU_ROWS + CPU_ROWS, ids=lambda r: r.name)
def test_every_row_asks_both_stacks_for_the_same_compile_ac_and_float8(row):
    mine, peer = _flags(row.titanlab_args()), _flags(row.torchtitan_args())
    assert mine["compile.enable"] == peer["compile.enable"] == str(row.compile).lower()
    for key in ("activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"):
        assert mine[key] == peer[key]
    if row.precision == "float8":
        assert mine["float8.recipe_name"] == peer["quantize.linear.float8.recipe_name"]
        assert peer["model.converters"] == "quantize.linear.float8"
    else:
        assert "float8.enable" not in mine and "model.converters" not in peer


def test_the_rows_cover_eager_compile_selective_ac_and_both_float8_recipes():
    names = {r.name for r in GPU_ROWS}
    assert names == {
        "bf16 · eager · AC none",
        "bf16 · compile · AC none",
        "bf16 · compile · AC selective",
        "float8 tensorwise · compile · AC none",
        "float8 rowwise · compile · AC none",
    }


@pytest.mark.parametrize(
    "shape,ffn", [(gpu_shape(3), 14336), (CPU_SHAPE, 1792)], ids=["8B-blocks", "cpu"]
)
def test_both_stacks_get_the_same_model_shape_and_batch(tmp_path, shape, ffn):
    folder = shape.titanlab_config(str(tmp_path / "m"))
    mine = titanlab_cmd(shape, CPU_ROWS[0], folder, str(tmp_path / "t.json"), _Args)
    config = build_config(mine[mine.index("--") + 1 :])
    args = build_model_args(config, 4096)
    # 14336 is Llama 3 8B's FFN; 1792 = 256 · ceil(int(1.3 · int(2 · 4 · 512 / 3)) / 256), the
    # rule torchtitan's llama3 applies to the same dim, multiplier and multiple.
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size) == (
        shape.dim, shape.layers, shape.heads, shape.kv_heads, shape.vocab)  # fmt: skip
    assert args.ffn_hidden_dim() == ffn
    assert (config.training.seq_len, config.training.local_batch_size) == (
        shape.seq_len, shape.local_batch)  # fmt: skip
    peer = _flags(torchtitan_cmd(shape, CPU_ROWS[0], str(tmp_path / "p.json"), _Args)[2:])
    assert (int(peer["dim"]), int(peer["layers"]), int(peer["heads"])) == (
        shape.dim, shape.layers, shape.heads)  # fmt: skip
    assert (int(peer["kv-heads"]), int(peer["vocab"])) == (shape.kv_heads, shape.vocab)
    assert (int(peer["training.seq_len"]), int(peer["training.local_batch_size"])) == (
        shape.seq_len, shape.local_batch)  # fmt: skip
    # Both optimizers and the clipping as llama_8b.toml has them.
    assert (config.optimizer.lr, config.optimizer.eps, config.training.max_norm) == (
        float(peer["optimizer.lr"]), float(peer["optimizer.eps"]),
        float(peer["training.max_norm"]))  # fmt: skip


def _row(step_s, params=1000, **extra):
    return dict(median_step_s=step_s, runs_s=[step_s], params=params, **extra)


def test_compare_gives_the_ratio_and_one_flop_count_for_both_mfus():
    shape = gpu_shape(2)  # 8192 tokens a step
    titan = _row(2.0, flops_per_token=1e9, peak_flops=1e15, max_allocated=30 * GIB)
    peer = _row(2.5, flops_per_token_torchtitan=2e9, max_allocated=40 * GIB)
    got = compare(shape, titan, peer)
    assert got["tps"] == {"titanlab": 4096.0, "torchtitan": 8192 / 2.5}
    assert got["ratio"] == pytest.approx(1.25)
    assert got["mfu"]["titanlab"] == pytest.approx(4096 * 1e9 / 1e15)
    assert got["mfu"]["torchtitan"] == pytest.approx(8192 / 2.5 * 1e9 / 1e15)
    assert got["memory"] == {"titanlab": 30 * GIB, "torchtitan": 40 * GIB}


def test_compare_refuses_models_of_different_sizes_and_passes_errors_on():
    shape = gpu_shape(2)
    got = compare(shape, _row(1.0, params=10), _row(1.0, params=11))
    assert got["error"] == "the models differ: 10 against 11 parameters"
    assert compare(shape, {"error": "CUDA out of memory"}, _row(1.0)) == {
        "error": "CUDA out of memory"
    }


def test_merge_takes_the_median_over_repeats_and_the_largest_peak():
    runs = [_row(s, peak_rss=p) for s, p in ((3.0, 5), (1.0, 7), (2.0, 6))]
    got = merge(runs + [{"error": "timed out"}])
    assert (got["median_step_s"], got["runs_s"], got["peak_rss"]) == (2.0, [3.0, 1.0, 2.0], 7)
    assert merge([{"error": "x"}]) == {"error": "x"}


def test_render_shows_each_row_its_ratio_and_the_errors():
    shape = gpu_shape(2)
    ok = compare(shape, _row(2.0, max_allocated=30 * GIB), _row(2.2, max_allocated=33 * GIB))
    text = render([(GPU_ROWS[3], ok), (GPU_ROWS[1], {"error": "a | b"})], shape, "H100", _Args)
    assert "| bf16 · eager · AC none | 4,096 | 3,724 | 1.100× | — | 30.00 · 33.00 |" in text
    assert "| float8 tensorwise · compile · AC none | a / b |" in text
    assert "torchtitan 0.2.2" in text and "H100" in text


def _tool(*args, pythonpath=REPO):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "benchmark_torchtitan.py"),
                           *args], capture_output=True, text=True, env=env, cwd=REPO)  # fmt: skip


def test_without_torchtitan_it_says_so_in_one_line(monkeypatch, capsys):
    import tools.benchmark_torchtitan as bench

    find = importlib.util.find_spec  # torchtitan is in the dev extra: hide it
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchtitan" else find(name, *a))  # fmt: skip
    assert bench.main(["--cpu"]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "benchmark_torchtitan: torchtitan is not installed; install it beside titanlab "
        "(pip install torchtitan==0.2.2, or `make peer-wheels` for an offline machine)"
    ]


def test_fewer_than_five_timed_steps_are_refused_in_one_line():
    proc = _tool("--steps", "6", "--warmup", "2")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("--steps 6 with --warmup 2 times 4 steps; at least 5 are needed")
    )


def test_random_tokens_are_shifted_labels_and_the_same_every_run():
    first = list(itertools.islice(iter(RandomTokens(2, 8, 50, seed=3)), 2))
    again = list(itertools.islice(iter(RandomTokens(2, 8, 50, seed=3)), 2))
    for (inputs, labels), (inputs2, labels2) in zip(first, again):
        ids = inputs["input"]
        assert ids.shape == labels.shape == (2, 8) and ids.dtype == torch.int64
        assert torch.equal(ids[:, 1:], labels[:, :-1]) and int(ids.max()) < 50
        assert torch.equal(ids, inputs2["input"]) and torch.equal(labels, labels2)
    assert not torch.equal(first[0][0]["input"], first[1][0]["input"])


def test_the_cpu_stand_in_answers_torchtitans_device_calls():
    assert CpuDevice.get_device_properties().total_memory > 2**30
    assert CpuDevice.memory_stats() == {} and CpuDevice.current_device() == 0
    CpuDevice.set_device(torch.device("cpu:0"))
    CpuDevice.reset_peak_memory_stats()
    CpuDevice.synchronize()
    assert Row("fp32", compile=False).torchtitan_args()[-2:] == [
        "--training.mixed_precision_param",
        "float32",
    ]
