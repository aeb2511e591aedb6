"""The feature-pair matrix's definitions: the factors and their levels, and a row's options
(`row_args`). The pre-flight's verdicts are `tools/lib/feature_verdicts.py`'s, the covering rows
`tools/lib/feature_covering.py`'s; `tools/feature_pairs.py` runs it, and its docstring gives the
method."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlab.planning.layouts import Layout
from tools.lib.runs import TINY_RUN

STEPS = 2
GLOBAL_BATCH = 4
# Rows with a bf16/fp16/float8 level train half the samples: on CPUs without native bf16
# (AVX2) a low-precision matmul runs ~40x slower than fp32, and such a row took 13-31 s
# against 3-8 s for an fp32 one (2-core AMD EPYC VM).
LOW_PRECISION_GLOBAL_BATCH = 2
FP32_TOLERANCE = 1e-5
LOW_PRECISION_TOLERANCE = 2e-2
EXPORT_TOLERANCE = 1e-4
WORLD_SIZE = 2


@dataclass(frozen=True)
class Level:
    """One value of a factor: the options that select it. `{data}`, `{chat}` and `{seed}` in
    them stand for the prepared token data, the prepared chat data and the model's seed
    checkpoint (`Fixtures`)."""

    factor: str
    name: str
    args: tuple[str, ...] = ()
    layout: Layout | None = None
    low_precision: bool = False

    @property
    def label(self) -> str:
        return f"{self.factor}={self.name}"

    @property
    def option_names(self) -> list[str]:
        """The `section.key` names this level sets (what a refusal must name)."""
        names = [a[2:] for a in self.args if a.startswith("--")]
        if self.layout is not None:
            names += [f"parallelism.{n}" for n in _LAYOUT_OPTIONS[self.name]]
        return names


def _layout(name: str, layout: Layout) -> Level:
    return Level("layout", name, layout=layout)


_LAYOUT_OPTIONS = {
    "fsdp2": ["data_parallel_shard_degree"],
    "ddp2": ["data_parallel_replicate_degree"],
    "tp2": ["tensor_parallel_degree"],
    "pp2": ["pipeline_parallel_degree", "pipeline_parallel_schedule"],
    "cp2": ["context_parallel_degree"],
    "ep2": ["expert_parallel_degree"],
}
_LORA = ("--peft.method", "lora", "--peft.rank", "4")
_FUSED_LOSS = ("--loss.fused_linear_cross_entropy", "true", "--loss.chunk_size", "32")

FACTORS: dict[str, tuple[Level, ...]] = {
    # The debug flavors' first blocks (`--model.n_layers`): 2, a pipeline stage each under PP 2
    # and a block with and one without selective_2's checkpoint (gpt-oss: a sliding and a full
    # block); Qwen3.5 keeps 4, its first full-attention block being the 4th. What a pair does to
    # a run does not depend on its depth, and the 6-block models took ~40% more of CI's time.
    "model": (
        Level("model", "dense", ("--model.name", "llama3", "--model.n_layers", "2")),
        Level("model", "moe", ("--model.name", "qwen3_moe", "--model.n_layers", "2")),
        Level("model", "local_attention", ("--model.name", "gpt_oss", "--model.n_layers", "2")),
        Level("model", "linear_attention", ("--model.name", "qwen3_5", "--model.n_layers", "4")),
    ),
    "layout": (
        _layout("fsdp2", Layout(1, 2, 1, 1, None, 1)),
        _layout("ddp2", Layout(2, 1, 1, 1, None, 1)),
        _layout("tp2", Layout(1, 1, 2, 1, None, 1)),
        _layout("pp2", Layout(1, 1, 1, 2, "1F1B", 1)),
        _layout("cp2", Layout(1, 1, 1, 1, None, 1, cp=2)),
        _layout("ep2", Layout(1, 2, 1, 1, None, 1, ep=2)),
    ),
    "peft": (
        Level("peft", "none"),
        Level("peft", "lora_attention", (*_LORA, "--peft.target_modules", "wq,wk,wv,wo")),
        Level("peft", "lora_mlp", (*_LORA, "--peft.target_modules", "w1,w2,w3")),
        Level("peft", "lora_output", (*_LORA, "--peft.target_modules", "wq,output")),
        Level("peft", "lora_router", (*_LORA, "--peft.target_modules", "wq,gate")),
        Level(
            "peft",
            "qlora",
            (*_LORA, "--peft.target_modules", "wq,wk,wv,wo", "--peft.quantize_base", "nf4"),
        ),
    ),
    "distill": (
        Level("distill", "off"),
        Level("distill", "on", ("--distill.teacher_path", "{seed}", "--distill.alpha", "0.5")),
    ),
    "compile": (
        Level("compile", "off"),
        Level("compile", "on", ("--compile.enable", "true")),
    ),
    "ac": (
        Level("ac", "none"),
        Level("ac", "full", ("--activation_checkpoint.mode", "full")),
        Level(
            "ac",
            "selective_op",
            (
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "op",
            ),
        ),
        Level(
            "ac",
            "selective_2",
            (
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "2",
            ),
        ),
    ),
    "precision": (
        Level("precision", "fp32"),
        Level(
            "precision",
            "bf16",
            (
                "--training.mixed_precision_param",
                "bfloat16",
                "--training.mixed_precision_on_cpu",
                "true",
            ),
            low_precision=True,
        ),
        Level(
            "precision",
            "fp16",
            (
                "--training.mixed_precision_param",
                "float16",
                "--training.mixed_precision_on_cpu",
                "true",
            ),
            low_precision=True,
        ),
    ),
    "float8": (
        Level("float8", "off"),
        Level(
            "float8",
            "on",
            ("--float8.enable", "true", "--float8.emulate", "true"),
            low_precision=True,
        ),
    ),
    "loss": (
        Level("loss", "plain", ("--loss.fused_linear_cross_entropy", "false")),
        # 32-token chunks: a microbatch of 2 × 64 tokens per rank is 4 of them (2 at batch 1)
        Level("loss", "fused", _FUSED_LOSS),
    ),
    "data": (
        Level("data", "tokens"),
        Level("data", "document_mask", ("--data.document_mask", "true")),
        Level("data", "chat", ("--data.dataset_path", "{chat}")),
    ),
    "optimizer": (
        Level("optimizer", "adamw"),
        # float32 Newton-Schulz: layouts agree with one process within 1e-5 (bfloat16's ~1e-3)
        Level(
            "optimizer",
            "muon",
            ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"),
        ),
    ),
}
FIRST = {factor: levels[0] for factor, levels in FACTORS.items()}

BASE_ARGS = [
    *TINY_RUN,
    "--model.flavor",
    "debugmodel",  # dim 256: every QLoRA target splits into whole NF4 blocks on 2 ranks
    "--training.steps",
    str(STEPS),
    "--training.mixed_precision_param",
    "float32",
    "--checkpoint.interval",
    "1000",
]


@dataclass(frozen=True)
class Fixtures:
    """Paths the levels' placeholders stand for: prepared token data, prepared chat data, and a
    seed checkpoint per model level (made by `make_fixtures`)."""

    data: str
    chat: str
    seeds: dict[str, str] = field(default_factory=dict)

    def fill(self, args: list[str], model: str) -> list[str]:
        subst = {"{data}": self.data, "{chat}": self.chat, "{seed}": self.seeds.get(model, "")}
        return [subst.get(a, a) for a in args]


Row = dict[str, Level]


def row_args(row: Row, fixtures: Fixtures, reference: bool = False) -> list[str]:
    """Command-line options of `row` on 2 ranks, or with `reference` on 1 process (the
    layout's global microbatches as accumulation steps)."""
    layout = row["layout"].layout
    assert layout is not None
    batch = global_batch(row)
    args = [*BASE_ARGS, "--data.dataset_path", "{data}"]
    if reference:
        # The layout's global microbatches (MoE's load-balance loss is taken over each one:
        # all data-parallel ranks' samples of one accumulation step or pipeline microbatch).
        micro = layout.grad_accum * ((layout.local_batch_size(batch) or 1) if layout.pp > 1 else 1)
        args += Layout(1, 1, 1, 1, None, 1).overrides(batch)
        args += ["--training.local_batch_size", str(batch // micro)]
    else:
        args += layout.overrides(batch)
        if layout.pp > 1:
            args += ["--parallelism.pipeline_parallel_microbatch_size", "1"]
    for factor in FACTORS:
        args += list(row[factor].args)
    # the architecture the seed checkpoint stores (its `--model.n_layers` first blocks)
    args += ["--model.flavor", "hf", "--checkpoint.initial_load_path", "{seed}"]
    return fixtures.fill(args, row["model"].name)


def global_batch(row: Row) -> int:
    """Samples per step of `row`: `LOW_PRECISION_GLOBAL_BATCH` where a level computes in low
    precision, else `GLOBAL_BATCH`."""
    low = any(lv.low_precision for lv in row.values())
    return LOW_PRECISION_GLOBAL_BATCH if low else GLOBAL_BATCH


def row_with(*levels: Level) -> Row:
    """The first level of every factor, but `levels` where they are given."""
    row = dict(FIRST)
    for level in levels:
        row[level.factor] = level
    return row


def row_name(row: Row) -> str:
    """The row's non-first levels, e.g. `moe-ep2-lora_attention-distill-selective_op` (a level
    named "on" is written as its factor)."""
    parts = [row["model"].name, row["layout"].name]
    parts += [
        f if lv.name == "on" else lv.name
        for f, lv in row.items()
        if f not in ("model", "layout") and lv != FIRST[f]
    ]
    return "-".join(parts)
