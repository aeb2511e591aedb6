"""`make gpu-check`: every GPU test, then the GPU benchmark rows, in one Markdown report.

    python tools/gpu_check.py [--out docs/gpu_check.md] [--perf docs/performance.md]
                              [--layers N] [--steps 12] [--skip-tests] [--skip-bench]
                              [--rows A,B] [--json FILE] [--trace-dir DIR] [--budget-s 570]

1. The machine: GPU name, memory, compute capability, driver, torch and CUDA versions; each
   package the tests or rows need that is missing is named in one line (its tests skip).
2. The GPU tests: `pytest -m gpu tests` (every test that skips without CUDA carries the `gpu`
   marker), each test's result and the first line of its failure or skip reason.
3. The benchmark rows, on one GPU: the real trainer (`tools/gpu_bench_row.py`, one process per
   row) on a Llama 3 8B-shaped model (dim 4096, 32/8 heads, FFN 14336, vocab 128256, seq 8192,
   local batch 1) with as many layers as the memory estimator says fit with AC none in bf16
   (`--layers` to choose), built through `model.flavor = "hf"`; bf16 eager and compiled, AC
   none and selective, float8 tensorwise and rowwise (torchao): tokens/s, TFLOP/s, MFU against
   the device's dense bf16 peak, the float8/bf16 ratio, the SDPA operator that ran, the GPU
   time by kernel kind of one profiled step, and `max_memory_allocated` against the estimate.

4. Where torchtitan is installed (`make peer-wheels`), `tools/benchmark_torchtitan.py` on the
   same layer count with the budget left: titanlab against torchtitan, row by row, into the
   `torchtitan-ab` block of `--perf` (`--skip-torchtitan` leaves it out).

The report goes to `--out` and into the `gpu-check` block of `--perf`. Rows run while less than
`--budget-s` seconds have passed since the start (one H100 runs the whole check in about
9 minutes); rows left out are named in the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.gpu_rows import bench_row, fit_layers

GIB = 2**30
# Packages the GPU tests and rows import, and what is lost without each.
PACKAGES = {
    "torchdata": "training (the data loader)",
    "tomli": "training configs on Python < 3.11",
    "tiktoken": "training (tokenizers)",
    "tokenizers": "Hugging Face tokenizers",
    "safetensors": "checkpoint conversion",
    "pytest": "the GPU tests",
    "torchao": "the float8 tests and rows",
    "transformers": "the Hugging Face comparison tests",
    "torchtitan": "the torchtitan A/B (tools/benchmark_torchtitan.py)",
}


@dataclasses.dataclass(frozen=True)
class Row:
    precision: str  # bf16 | float8
    recipe: str = ""  # float8: tensorwise | rowwise
    compile: bool = True
    ac: str = "none"
    cudnn_sdpa: bool = True  # False: SDPA's cuDNN backend off, torch's flash (FA2) kernel
    optimizer: str = "AdamW"  # AdamW | Muon
    document_mask: bool = False  # True: block-causal FlexAttention over the packed documents
    loss_chunk: int = 0  # > 0: the fused loss's loss.chunk_size (0: the config's)

    @property
    def name(self) -> str:
        prec = f"float8 {self.recipe}" if self.precision == "float8" else "bf16"
        sdpa = "" if self.cudnn_sdpa else " · FA2 (cuDNN SDPA off)"
        extra = (
            (" · Muon" if self.optimizer == "Muon" else "")
            + (" · document mask" if self.document_mask else "")
            + (f" · loss chunk {self.loss_chunk}" if self.loss_chunk else "")
        )
        return f"{prec} · {'compile' if self.compile else 'eager'} · AC {self.ac}{sdpa}{extra}"

    @property
    def is_baseline(self) -> bool:
        """The row others' "vs bf16" divides by: bf16, compiled, cuDNN SDPA, AdamW, causal."""
        plain = self.optimizer == "AdamW" and not self.document_mask and not self.loss_chunk
        return self.precision == "bf16" and self.compile and self.cudnn_sdpa and plain

    def args(self) -> list[str]:
        out = [
            "--compile.enable",
            str(self.compile).lower(),
            "--activation_checkpoint.mode",
            self.ac,
        ]
        if self.precision == "float8":
            out += ["--float8.enable", "true", "--float8.recipe_name", self.recipe]
        if self.optimizer != "AdamW":
            out += ["--optimizer.name", self.optimizer]
        if self.document_mask:
            out += ["--data.document_mask", "true"]
        if self.loss_chunk:
            out += ["--loss.chunk_size", str(self.loss_chunk)]
        return out


ROWS = (
    Row("bf16", compile=True, ac="none"),
    Row("bf16", compile=True, ac="none", cudnn_sdpa=False),
    Row("float8", "tensorwise", compile=True, ac="none"),
    Row("float8", "rowwise", compile=True, ac="none"),
    Row("bf16", compile=True, ac="selective"),
    Row("float8", "tensorwise", compile=True, ac="selective"),
    Row("bf16", compile=False, ac="none"),
    Row("bf16", compile=True, ac="none", loss_chunk=2048),
    Row("bf16", compile=True, ac="none", optimizer="Muon"),
    Row("bf16", compile=True, ac="none", document_mask=True),
)


def probe() -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gpus": torch.cuda.device_count(),
        "missing": [f"{p}: {what}" for p, what in PACKAGES.items() if not _has(p)],
    }
    if info["gpus"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            memory=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            driver=_driver(),
        )
    return info


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown (nvidia-smi gave none)"


def run_tests(timeout_s: int) -> tuple[list[dict], str]:
    """(one dict per GPU test: name, outcome, seconds, message), pytest's summary line."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(
                [*cmd, f"--junitxml={xml}", "tests"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")[-2000:]
            return [], f"timed out after {timeout_s} s: {tail!r}"
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        if not os.path.exists(xml):
            return [], summary
        return parse_junit(xml), summary


def parse_junit(path: str) -> list[dict]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tests.append(
            {"name": name, "outcome": outcome, "s": float(case.get("time", 0)), "msg": message}
        )
    return tests


def model_config(layers: int, folder: str) -> str:
    """A Hugging Face config.json of Llama 3.1 8B's dims with `layers` blocks; its folder."""
    import torch

    from titanlab.models.llama3 import llama3_flavors
    from titanlab.models.llama3.hf import to_config

    args = dataclasses.replace(llama3_flavors["8B"], n_layers=layers, vocab_size=128256)
    cfg = to_config(args, torch.bfloat16, 8192, None, None)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return folder


def trainer_args(folder: str, dump: str, steps: int) -> list[str]:
    return [
        "--job.config_file",
        os.path.join(REPO, "train_configs", "llama_8b.toml"),
        "--job.dump_folder",
        dump,
        "--model.flavor",
        "hf",
        "--model.hf_config",
        folder,
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "false",
        "--metrics.log_freq",
        "1",
    ]


def run_row(row: Row, layers_dir: str, steps: int, warmup: int, out_dir: str, trace: str) -> dict:
    bench = [*(["--trace", trace] if trace else []),
             *([] if row.cudnn_sdpa else ["--no-cudnn-sdpa"])]  # fmt: skip
    dump = os.path.join(out_dir, "dump")
    return bench_row([*trainer_args(layers_dir, dump, steps), *row.args()], out_dir, warmup, bench)


def run_torchtitan_ab(a: argparse.Namespace, layers: int, info: dict, start: float) -> str:
    """`tools/benchmark_torchtitan.py` on `layers` blocks with the budget left; its table, or
    the one line saying why it did not run."""
    if not _has("torchtitan"):
        return "Not run: torchtitan is not installed (`make peer-wheels`)."
    left = int(a.budget_s - (time.time() - start))
    if left < 120:
        return f"Not run: {max(left, 0)} s of the {a.budget_s} s budget left."
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ab.md")
        cmd = [sys.executable, os.path.join(REPO, "tools", "benchmark_torchtitan.py"),
               "--layers", str(layers or fit_layers(info["memory"], 0.7)), "--budget-s",
               str(left), "--out", out, "--perf", a.perf]  # fmt: skip
        print(f"gpu-check: torchtitan A/B, {left} s left ...", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
        if not os.path.exists(out):
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            return f"Failed: exit {proc.returncode}: {(lines or [''])[-1][:300]}"
        with open(out, encoding="utf-8") as f:
            return f.read().split("\n", 2)[2].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "gpu_check.md"))
    p.add_argument("--perf", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--layers", type=int, default=0, help="blocks (0: as many as fit)")
    p.add_argument("--steps", type=int, default=12, help="trainer steps per row")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-torchtitan", action="store_true", help="no torchtitan A/B")
    p.add_argument("--tests-timeout-s", type=int, default=240)
    p.add_argument("--budget-s", type=int, default=570, help="no row starts after this")
    p.add_argument(
        "--rows",
        default="",
        help="only the rows whose name contains one of these (comma-separated)",
    )
    p.add_argument("--json", default="", help="also write every figure here")
    p.add_argument("--trace-dir", default="", help="Chrome trace of the first row's step here")
    a = p.parse_args(argv)
    start = time.time()
    info = probe()
    for line in info["missing"]:
        print(f"gpu-check: missing package {line} will skip")
    if not info["gpus"]:
        print(f"gpu-check: torch {info['torch']} sees no CUDA GPU; run it on a machine with one")
        return 2
    print(f"gpu-check: {info['gpu']}, driver {info['driver']}, torch {info['torch']}", flush=True)
    tests, summary = ([], "not run") if a.skip_tests else run_tests(a.tests_timeout_s)
    rows: list[tuple[Row, dict]] = []
    layers = 0
    if not a.skip_bench:
        layers = a.layers or fit_layers(info["memory"])
        with tempfile.TemporaryDirectory() as tmp:
            folder = model_config(layers, os.path.join(tmp, "model"))
            for k, row in enumerate(ROWS):
                if a.rows and not any(part in row.name for part in a.rows.split(",")):
                    continue
                if time.time() - start > a.budget_s:
                    rows.append((row, {"error": f"not run: past the {a.budget_s} s budget"}))
                    continue
                print(f"gpu-check: row {row.name}, {layers} layers ...", flush=True)
                trace = (
                    os.path.join(a.trace_dir, "trace_bf16.json.gz")
                    if a.trace_dir and k == 0
                    else ""
                )
                out_dir = os.path.join(tmp, f"row{k}")
                os.makedirs(out_dir)
                result = run_row(row, folder, a.steps, a.warmup, out_dir, trace)
                print(json.dumps(result)[:1500], flush=True)
                rows.append((row, result))
    from tools.lib.gpu_report import render_report

    peer = "" if a.skip_torchtitan else run_torchtitan_ab(a, layers, info, start)
    report = render_report(info, tests, summary, layers, rows, time.time() - start)
    report += f"\n## titanlab against torchtitan\n\n{peer}\n" if peer else ""
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(report)
    from tools.lib.bench import write_block

    # Inside docs/performance.md the report sits under a section: its headings go one level down.
    write_block(a.perf, "gpu-check", report.split("\n", 2)[2].strip().replace("\n## ", "\n### "))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "info": info,
                    "tests": tests,
                    "layers": layers,
                    "rows": [[r.name, d] for r, d in rows],
                },
                f,
                indent=1,
            )
    print(report)
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    from tools.lib.gpu_report import estimate_error

    off = [r.name for r, d in rows if "error" not in d and abs(estimate_error(d)) > 0.10]
    for name in off:
        print(f"gpu-check: the memory estimate of row {name} is more than 10% off")
    return 1 if failed or off or any("error" in d for _, d in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
