"""The `[model]` section of a job: which family and size to build, and the family's options."""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.config.errors import _require


@dataclass
class Model:
    name: str = "llama3"
    """Model family, from the model registry: `llama3` (Llama 3 / 3.1 / 3.2), `qwen3` (Qwen3
    dense), `qwen3_moe` (Qwen3-MoE), `deepseek_v3` (DeepSeek-V3, Moonlight), `gpt_oss`
    (gpt-oss), `qwen3_5` (Qwen3.5 dense hybrid) or `qwen3_5_moe` (Qwen3.5-MoE hybrid).
    `python -m titanlab.train --help` lists each family's flavors."""

    flavor: str = "debugmodel"
    """A published size of the family (llama3: debugmodel, debugmodel_deep, debugmodel_tiny, 1B, 3B, 8B, 70B,
    405B; qwen3: debugmodel, debugmodel_deep, 0.6B, 1.7B, 4B, 8B, 14B, 32B; qwen3_moe:
    debugmodel, debugmodel_deep, debugmodel_2_experts, 30B-A3B, 235B-A22B; deepseek_v3: debugmodel, debugmodel_deep,
    16B, 671B; gpt_oss: debugmodel, debugmodel_deep, 20b, 120b; qwen3_5: debugmodel,
    debugmodel_deep, 0.8B, 2B, 4B, 9B, 27B; qwen3_5_moe: debugmodel, debugmodel_deep, 35B-A3B,
    122B-A10B, 397B-A17B), or `hf`: the
    architecture of `model.hf_config`, or of the `model_args.json` stored in
    `checkpoint.initial_load_path` (any shape of the family, e.g. an imported checkpoint)."""

    hf_config: str = ""
    """With `model.flavor = "hf"`: a Hugging Face `config.json` (or the folder holding it) whose
    architecture to build. Empty: the args stored with `checkpoint.initial_load_path`."""

    n_layers: int = 0
    """Build only the architecture's first `n_layers` blocks (0: all of them), the others'
    kinds kept as `titanlab.models.common.shortened` says (DeepSeek-V3's dense first block, the
    later blocks MoE): a real width at a depth one device holds, as the GPU benchmark rows run
    Llama 3 8B's 11 of 32 blocks, and the per-block costs the planner prices."""

    tokenizer_path: str = ""
    """A tiktoken `tokenizer.model` (Llama 3 format) or a Hugging Face `tokenizer.json` (its
    special tokens from `tokenizer_config.json` beside it). Empty: the bundled 4k BPE trained
    on the Python standard library."""

    moe_load_balance_coeff: float = -1.0
    """MoE models: weight of the auxiliary load-balance loss (Switch/GShard form over the global
    microbatch; 0 turns it off). -1: the flavor's (Qwen3-MoE: 0.001)."""

    moe_bias_update_speed: float = -1.0
    """MoE models: step of the auxiliary-loss-free expert bias (DeepSeek-V3) per optimizer step
    (0: off). -1: the flavor's (0, off)."""

    moe_load_balance_type: str = ""
    """MoE models: the load-balance loss's form, "global" (Switch/GShard over the global
    microbatch) or "sequence" (DeepSeek-V3's sequence-wise loss, each sequence's own; not with
    tensor or context parallel). Empty: the flavor's (Qwen3-MoE: global, DeepSeek-V3:
    sequence)."""

    moe_grouped_mm: str = "auto"
    """MoE models: the routed experts as grouped GEMMs (`torch._grouped_mm`, one kernel for all
    experts) or as the exact per-expert loop. "auto": grouped where it is a GPU kernel (bf16 on
    a Hopper-class GPU), else the loop; "on": grouped wherever torch runs it (the CPU's bf16
    too, where a test then takes the GPU's code path: the MoE layer compiles with its block,
    `titanlab.distributed.compile.moe_compile_mode`); "off": the loop."""

    mtp_loss_weight: float = -1.0
    """Models with multi-token prediction depths (deepseek_v3): λ, the weight of their loss
    (0: not computed, the depths do not train). -1: the flavor's (DeepSeek-V3: 0.3)."""

    def validate(self) -> None:
        for name in ("moe_load_balance_coeff", "moe_bias_update_speed", "mtp_loss_weight"):
            value = getattr(self, name)
            _require(
                value == -1.0 or value >= 0,
                f"model.{name}={value} must be >= 0, or -1 for the flavor's value",
            )
        _require(
            self.n_layers >= 0, f"model.n_layers={self.n_layers} must be >= 0 (0: every block)"
        )
        _require(
            self.moe_grouped_mm in ("auto", "on", "off"),
            f"model.moe_grouped_mm={self.moe_grouped_mm!r}; valid: auto, on, off",
        )
        _require(
            self.moe_load_balance_type in ("", "global", "sequence"),
            f"model.moe_load_balance_type={self.moe_load_balance_type!r}; valid: global, "
            "sequence, or empty for the flavor's",
        )
        # The family and flavor are checked against the model registry in the pre-flight
        # (`titanlab.components.builders.build_model_args`): config/ stays a leaf of the package.
        _require(bool(self.name), "model.name must not be empty")
        _require(bool(self.flavor), "model.flavor must not be empty")
        _require(
            not self.hf_config or self.flavor == "hf",
            f"model.hf_config={self.hf_config!r} is read only with model.flavor=hf, not "
            f"model.flavor={self.flavor} (a published shape); set model.flavor=hf or drop "
            "model.hf_config",
        )
