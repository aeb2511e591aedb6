"""Model families, one folder each (`llama3`, `qwen3`, `qwen3_moe`), their shared blocks
(`common`: attention, RoPE, MoE, the decoder) and the registry of families and flavors.

Plain PyTorch: a model knows nothing of parallelism, precision policies or the data pipeline.
May import `config` only.
"""
