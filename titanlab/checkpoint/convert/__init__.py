"""Streamed conversion between titanlab DCP checkpoints and Hugging Face folders (any family of
the model registry: `LlamaForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, whose
per-expert tensors are stacked into one titanlab tensor per projection and layer).

`dcp_to_hf` reads the model weights of a DCP checkpoint of any parallel layout (the `model.*`
keys; optimizer and the rest are ignored) one stored chunk at a time, and writes
`model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json`, `config.json`,
`generation_config.json` and, when the tokenizer is known, the tokenizer files. `hf_to_dcp` reads
a Hugging Face folder one tensor at a time and writes a model-only DCP folder of the form
`Checkpointer.save_model_only` writes (`{"model": ..., "train_state": {"step": 0}}`) plus the
model args derived from its config.json (`model_args.json`), which
`checkpoint.initial_load_path` loads. Both directions map names and permute wq/wk (and the
q/k norms) with `titanlab.models.common.hf_adapter`; the config mapping is the family's.

Memory: neither direction holds more than about one tensor (the I/O is in
`titanlab.checkpoint.streaming`); measurements in docs/checkpoint_conversion.md.
"""

from titanlab.checkpoint.convert.common import (
    DTYPES,
    expected_shapes,
    parse_size,
    resolve_dcp_model,
)
from titanlab.checkpoint.convert.from_hf import hf_to_dcp
from titanlab.checkpoint.convert.to_hf import dcp_to_hf
from titanlab.checkpoint.streaming import ConversionError, DcpModelReader, LazyModelPlanner

__all__ = [
    "DTYPES",
    "ConversionError",
    "DcpModelReader",
    "LazyModelPlanner",
    "dcp_to_hf",
    "expected_shapes",
    "hf_to_dcp",
    "parse_size",
    "resolve_dcp_model",
]
