"""Running the feature-pair matrix's rows (`tools/feature_pairs.py` chooses them): the shared
fixtures (token data, chat data, a seed checkpoint per model), a row on 2 ranks against 1 eager
process, the checks of its export, and the markdown table."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tools.lib.feature_matrix import (
    BASE_ARGS,
    EXPORT_TOLERANCE,
    FACTORS,
    FP32_TOLERANCE,
    LOW_PRECISION_TOLERANCE,
    STEPS,
    WORLD_SIZE,
    Fixtures,
    Level,
    Row,
    row_args,
    row_name,
)
from tools.lib.runs import failure_line, launch, read_losses


@dataclass
class RowOutcome:
    """One row's result: worst |Δloss| against 1 process, the export check, or the failure."""

    row: str
    max_abs_diff: float | None = None
    tolerance: float = FP32_TOLERANCE
    export: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.max_abs_diff is not None
            and self.max_abs_diff <= self.tolerance
        )


def _run(nproc: int, args: list[str], dump: str) -> str | None:
    """Launch and return None, or the failure line (the whole output kept in launch.log)."""
    proc = launch(nproc, args + ["--job.dump_folder", dump])
    if proc.returncode == 0:
        return None
    os.makedirs(dump, exist_ok=True)
    output = proc.stdout + "\n" + proc.stderr
    with open(os.path.join(dump, "launch.log"), "w", encoding="utf-8") as f:
        f.write(output)
    return f"exit {proc.returncode}: {failure_line(output)} (log: {dump}/launch.log)"


def launch_row(
    row: Row, fixtures: Fixtures, root: str, compile_backend: str = "inductor"
) -> RowOutcome:
    """Train `row` on 2 ranks and its reference on 1 process (subprocesses) and compare the
    losses; the export is checked by `finish_row`. The reference has the row's options with
    compile off: a compiled row must train like the eager single process, which also proves
    compile alone (and saves the reference's compilation). `compile_backend`: torch.compile's
    backend where the row compiles (CI's covering rows use "aot_eager": Dynamo's capture and
    AOTAutograd's joint graph, which is where features meet compile, without Inductor's C++
    build; Inductor's numerics are in test_compile.py)."""
    name = row_name(row)
    start = time.time()
    low = any(lv.low_precision for lv in row.values())
    out = RowOutcome(name, tolerance=LOW_PRECISION_TOLERANCE if low else FP32_TOLERANCE)
    dump = os.path.join(root, "rows", name)
    backend = ["--compile.backend", compile_backend] if row["compile"].name == "on" else []
    ref_args = row_args({**row, "compile": FACTORS["compile"][0]}, fixtures, reference=True)
    ref_key = json.dumps(ref_args)
    ref = os.path.join(root, "references", hashlib.sha1(ref_key.encode()).hexdigest()[:12])
    if not os.path.exists(os.path.join(ref, "metrics.jsonl")):
        out.error = _run(1, ref_args, ref)
    if out.error is None:
        export = ["--checkpoint.enable", "true", "--checkpoint.export_dtype", "float32"]
        out.error = _run(WORLD_SIZE, row_args(row, fixtures) + backend + export, dump)
    if out.error is None:
        got, want = read_losses(dump), read_losses(ref)
        if sorted(got) != list(range(1, STEPS + 1)):
            out.error = f"logged steps {sorted(got)}, expected 1..{STEPS}"
        else:
            out.max_abs_diff = max(abs(got[s] - want[s]) for s in got)
    out.seconds = time.time() - start
    return out


def finish_row(out: RowOutcome, row: Row, fixtures: Fixtures, root: str) -> RowOutcome:
    """`out` with the row's export checked (`check_export`, in this process) when it trained."""
    if out.error is None:
        start = time.time()
        checkpoint = os.path.join(root, "rows", out.row, "checkpoint")
        try:
            out.export = check_export(row, checkpoint, fixtures)
        except Exception as e:  # the export check's failure is the row's failure
            out.error = f"export: {type(e).__name__}: {e}"
        out.seconds += time.time() - start
    return out


def run_row(
    row: Row, fixtures: Fixtures, root: str, compile_backend: str = "inductor"
) -> RowOutcome:
    """One row: `launch_row`, then `finish_row`."""
    return finish_row(launch_row(row, fixtures, root, compile_backend), row, fixtures, root)


def run_rows(
    rows: list[Row],
    fixtures: Fixtures,
    root: str,
    compile_backend: str = "inductor",
    on_outcome: Callable[[RowOutcome], None] | None = None,
) -> list[RowOutcome]:
    """`run_row` for every row, in order; the launches of the next rows (subprocesses, from a
    worker thread) run while this process checks the previous row's export, so a 2-core
    machine is not left with a core idle during the single-process parts. `on_outcome` is called
    with each finished row, in order."""
    outcomes = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        launched = [pool.submit(launch_row, r, fixtures, root, compile_backend) for r in rows]
        for row, future in zip(rows, launched):
            outcomes.append(finish_row(future.result(), row, fixtures, root))
            if on_outcome is not None:
                on_outcome(outcomes[-1])
    return outcomes


def check_export(row: Row, checkpoint_root: str, fixtures: Fixtures) -> str:
    """Load the row's final export everywhere it loads and compare logits with titanlab's own
    loader (`titanlab.generation.loading.load_model`, which merges LoRA adapters): the Hugging
    Face folder in transformers (`to-hf`, `--merge-lora` for LoRA runs), the PEFT adapter on
    the base in peft (`to-peft`, LoRA on an unquantized base), and a greedy continuation of a
    prompt longer than the training `seq_len` (the export records the model's context length).
    Returns a short summary; raises AssertionError naming the gap."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from titanlab.checkpoint.convert import dcp_to_hf
    from titanlab.generation.generate import generate
    from titanlab.generation.loading import load_model
    from titanlab.checkpoint.peft_export import dcp_to_peft

    exports = [d for d in os.listdir(checkpoint_root) if d.startswith("export-step-")]
    assert exports, f"no export-step-N in {checkpoint_root}"
    export = os.path.join(checkpoint_root, exports[0])
    model, _, args = load_model(export, torch.device("cpu"))
    tokens = torch.arange(3, 3 + 96).remainder(args.vocab_size - 300).unsqueeze(0) + 5
    with torch.no_grad():
        ours = model(tokens).float()
    lora = row["peft"].name != "none"
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        dcp_to_hf(export, hf, dtype=torch.float32, progress=False, merge_lora=lora)
        theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (theirs(tokens).logits - ours).abs().max().item()
        assert diff <= EXPORT_TOLERANCE, f"to-hf logits differ by {diff:.2e}"
        notes.append(f"hf {diff:.1e}")
        if lora and row["peft"].name != "qlora":
            from peft import PeftModel

            base = os.path.join(tmp, "base")
            dcp_to_hf(fixtures.seeds[row["model"].name], base, dtype=torch.float32, progress=False)
            adapter = os.path.join(tmp, "adapter")
            dcp_to_peft(export, adapter)
            plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(row["precision"].name)
            if compute is not None:  # LoRA stored the frozen base in the compute dtype,
                with torch.no_grad():  # all but MoE routers (`store_frozen_in`)
                    for name, p in plain.named_parameters():
                        if not name.endswith(
                            ("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")
                        ):
                            p.copy_(p.to(compute).float())
            peft_model = PeftModel.from_pretrained(plain, adapter).eval()
            with torch.no_grad():
                diff = (peft_model(tokens).logits - ours).abs().max().item()
            assert diff <= EXPORT_TOLERANCE, f"to-peft logits differ by {diff:.2e}"
            notes.append(f"peft {diff:.1e}")
    prompt = tokens[:, :80]  # longer than the training seq_len (64)
    out = generate(model, prompt.tolist(), max_new_tokens=4)
    assert len(out[0]) == 4, f"generated {len(out[0])} tokens, not 4"
    notes.append("generate 80+4")
    return ", ".join(notes)


def make_fixtures(root: str) -> Fixtures:
    """Prepared token and chat data under `root` and a seed checkpoint per model level (made
    once, reused)."""
    data = os.path.join(root, "data")
    chat = os.path.join(root, "chat")
    if not os.path.exists(os.path.join(data, "metadata.json")):
        from titanlab.data.default_corpus import default_corpus_files
        from titanlab.data.prepare import prepare_data
        from titanlab.data.tokenizer import default_tokenizer_path

        files = [f for f in default_corpus_files() if os.sep + "email" + os.sep in f][:40]
        prepare_data(
            files, data, default_tokenizer_path(), workers=1, shard_size_mb=0.25, progress=False
        )
    if not os.path.exists(os.path.join(chat, "metadata.json")):
        write_chat_data(chat)
    fixtures = Fixtures(data, chat)
    for level in FACTORS["model"]:
        seed_root = os.path.join(root, f"seed-{level.name}")
        seed = os.path.join(seed_root, "checkpoint", "step-0")
        if not os.path.exists(os.path.join(seed, ".metadata")):
            args = [*BASE_ARGS, *level.args, "--data.dataset_path", data]
            args += ["--checkpoint.enable", "true", "--checkpoint.create_seed_checkpoint", "true"]
            error = _run(1, args, seed_root)
            if error:
                raise RuntimeError(f"seed checkpoint of {level.label}: {error}")
        fixtures.seeds[level.name] = seed
    return fixtures


def write_chat_data(out: str) -> None:
    """Chat SFT data: questions about stdlib functions answered with their docstrings,
    prepared with the bundled tokenizer (`tools/prepare_data.py --format chat`)."""
    import ast

    from titanlab.data.default_corpus import default_corpus_files
    from titanlab.data.prepare_chat import prepare_chat
    from titanlab.data.tokenizer import default_tokenizer_path

    os.makedirs(out, exist_ok=True)
    jsonl = os.path.join(out + "-src.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for path in default_corpus_files()[:30]:
            with open(path, encoding="utf-8") as src:
                tree = ast.parse(src.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                    doc = (ast.get_docstring(node) or "")[:300]
                    messages = [
                        {"role": "user", "content": f"What does {node.name} do?"},
                        {"role": "assistant", "content": doc},
                    ]
                    f.write(json.dumps({"messages": messages}) + "\n")
    prepare_chat([jsonl], out, default_tokenizer_path(), progress=False)


def write_doc(
    path: str,
    verdicts: dict[tuple[Level, Level], str | None],
    rows: list[Row],
    outcomes: list[RowOutcome],
    command: str,
) -> None:
    """`path` (markdown): the factors and levels, every refused pair with its line, and each
    row's result when rows were trained."""
    import platform

    lines = [
        "# Feature pairs",
        "",
        "Generated by `python tools/feature_pairs.py` (see its docstring for the method); "
        f"command: `{command}`, on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cores), torch {_torch_version()}, CPU, gloo.",
        "",
        "## Factors and levels",
        "",
        "| factor | levels (the first is the default of every other pair) |",
        "|---|---|",
    ]
    for factor, levels in FACTORS.items():
        lines.append(f"| {factor} | {', '.join(lv.name for lv in levels)} |")
    refused = [(p, why) for p, why in verdicts.items() if why is not None]
    lines += [
        "",
        f"## Refused pairs ({len(refused)} of {len(verdicts)}), each before launch",
        "",
        "| pair | the pre-flight's line |",
        "|---|---|",
    ]
    for (a, b), why in refused:
        lines.append(f"| {a.label} × {b.label} | {str(why).replace('|', '/')} |")
    if outcomes:
        lines += [
            "",
            f"## Rows ({len(rows)}): 2 ranks against 1 eager process, {STEPS} steps, then the "
            "export",
            "",
            "| row | worst \\|Δloss\\| | bound | export | result |",
            "|---|---|---|---|---|",
        ]
        for o in outcomes:
            diff = "—" if o.max_abs_diff is None else f"{o.max_abs_diff:.1e}"
            result = "pass" if o.passed else f"**failed**: {o.error}"
            lines.append(f"| {o.row} | {diff} | {o.tolerance:g} | {o.export or '—'} | {result} |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _torch_version() -> str:
    import torch

    return torch.__version__
