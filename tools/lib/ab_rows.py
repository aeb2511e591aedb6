"""The rows of the titanlab / torchtitan A/B (`tools/benchmark_torchtitan.py` measures them,
`tools/ledger_ab.py` and the ledger's gate 4 price them): each row's precision, compile and
activation checkpointing, and the same options in each stack's own command-line terms."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Row:
    precision: str  # bf16 | fp32 | float8
    compile: bool
    ac: str = "none"  # none | selective (per op)
    recipe: str = ""  # float8: tensorwise | rowwise

    @property
    def name(self) -> str:
        prec = f"float8 {self.recipe}" if self.precision == "float8" else self.precision
        return f"{prec} · {'compile' if self.compile else 'eager'} · AC {self.ac}"

    def titanlab_args(self) -> list[str]:
        out = ["--compile.enable", str(self.compile).lower(), "--activation_checkpoint.mode"]
        out += [self.ac, "--activation_checkpoint.selective_ac_option", "op"]
        if self.precision == "float8":
            out += ["--float8.enable", "true", "--float8.recipe_name", self.recipe]
        return out

    def torchtitan_args(self) -> list[str]:
        out = ["--activation_checkpoint.mode", self.ac]
        out += ["--activation_checkpoint.selective_ac_option", "op"]
        out += ["--compile.enable"] if self.compile else ["--compile.no-enable"]
        if self.precision == "float8":
            out += ["--model.converters", "quantize.linear.float8"]
            out += ["--quantize.linear.float8.recipe_name", self.recipe]
            out += ["--quantize.linear.float8.filter_fqns", "output"]
        if self.precision == "fp32":
            out += ["--training.mixed_precision_param", "float32"]
        return out


# In order of value: a run cut off by its budget still has the rows users pick first.
GPU_ROWS = (
    Row("bf16", compile=True),
    Row("float8", compile=True, recipe="tensorwise"),
    Row("bf16", compile=True, ac="selective"),
    Row("bf16", compile=False),
    Row("float8", compile=True, recipe="rowwise"),
)
CPU_ROWS = (Row("fp32", compile=False), Row("fp32", compile=True))
