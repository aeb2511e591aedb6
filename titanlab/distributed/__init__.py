"""Parallelism applied from outside the model, on a DeviceMesh (`parallel_dims`): FSDP2/HSDP
and DDP, tensor/sequence parallel, pipeline, context and expert parallel (`parallelize`,
`pipeline`, ...), activation checkpointing, process-group set-up and collective helpers.

May import `config`, `models`, `precision` and `peft` (it shards LoRA and NF4 modules).
"""
