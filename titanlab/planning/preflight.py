"""Checks that need no process group: run them before launching (`python -m
titanlab.preflight`, `titanlab/preflight.py`), and again in every rank (`Trainer`).

`check` resolves the layout, the batch split, the model and tokenizer, the files the run reads,
the memory estimate and the feature pairs the trainer refuses; a config that cannot run raises
ConfigError with one line, before any process group or file is created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from titanlab.components import builders as components
from titanlab.components.liger import check_liger
from titanlab.data.build import build_data
from titanlab.posttrain.rl.checks import check_rl
from titanlab.posttrain.teacher import teacher_args
from titanlab.checkpoint import store
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.tokenizer import AnyTokenizer
from titanlab.distributed.activation_offload import check_offload
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.metrics.mlflow_sink import check_mlflow
from titanlab.distributed.parallelize import param_dtype
from titanlab.distributed.tensor_parallel.one_d import linear_split_dims
from titanlab.planning.layouts import check_parallel_layout
from titanlab.planning.cluster import Cluster
from titanlab.planning.memory import MemoryEstimate, check_memory
from titanlab.planning.validate import validate_tp_mode
from titanlab.models.registry import ModelFamily
from titanlab.peft.lora import lora_targets
from titanlab.peft.qlora import shard_problem
from titanlab.resilience.diloco import fragment_names


@dataclass
class Plan:
    """What the checks resolved, for the trainer to use."""

    parallel_dims: ParallelDims
    batch: components.BatchLayout
    tokenizer: AnyTokenizer
    family: ModelFamily
    model_args: Any
    memory: MemoryEstimate | None
    """None where `check` was asked not to estimate it (`memory=False`)."""


def check(
    config: JobConfig,
    world_size: int,
    local_world_size: int,
    target: Cluster | None = None,
    memory: bool = True,
) -> Plan:
    """Validate the layout, batch sizes, tokenizer, model dims and memory. Raises ConfigError.

    `target`: the devices a dry run (`comm.mode = "fake_backend"`) is meant for, whose type,
    compute dtype and memory replace this machine's; None: this machine's. `memory=False`
    leaves out the memory estimate and its check (the activation trace, a fraction of a second
    to seconds), for a caller that judges only the rules of layouts and features, such as the
    feature-pair matrix (`tools/lib/feature_matrix.py`); the trainer always checks it.
    """
    family = components.build_family(config)
    tokenizer = components.build_tokenizer(config)
    model_args = components.build_model_args(config, tokenizer.vocab_size)
    # What 2D / 3D tensor parallel cannot take (the model's experts, MLA) decides before any
    # degree; then the degrees, the cheapest check, before the rest.
    validate_tp_mode(config, model_args)
    ParallelDims.from_config(config.parallelism, world_size)
    if target is not None:
        device = torch.device(target.device_type)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    targets = {}
    if config.peft.method == "lora":  # the target names, on a meta-device model
        meta = components.build_meta_model(model_args)
        targets = lora_targets(meta, config.peft, config.model.name)
    check_liger(config.kernels.liger, device)
    check_offload(config.activation_checkpoint.offload, device)
    check_mlflow(config.metrics.enable_mlflow, config.metrics.mlflow_tracking_uri)
    parallel_dims = check_parallel_layout(config, world_size, model_args, device.type)
    if targets and parallel_dims.pp > 1:
        check_stage_targets(meta, config, parallel_dims.pp, targets)
    if config.peft.quantize_base == "nf4":  # each NF4 weight must split into whole blocks
        shards, tp = parallel_dims.dp_shard * parallel_dims.cp, parallel_dims.tp
        split = linear_split_dims(meta) if tp > 1 else {}
        for name, linear in targets.items():
            shape = tuple(linear.weight.shape)
            tp_split = (tp, split[name]) if name in split else (1, 0)
            problem = shard_problem(f"{name}.weight", shape, shards, *tp_split)
            if problem:
                raise ConfigError(
                    f"peft.quantize_base=nf4 on model.name={config.model.name} "
                    f"(flavor {config.model.flavor}): {problem}; use fewer FSDP or TP ranks or "
                    "other targets"
                )
    batch = components.batch_layout(config, parallel_dims.dp_degree)
    check_rl(config, batch, tokenizer)
    ft = config.fault_tolerance
    if ft.enable and ft.semi_sync_method == "diloco" and ft.fragments > 1:
        fragment_names(components.build_meta_model(model_args), ft.fragments)  # enough blocks
    if config.distill.teacher_path:
        teacher_args(config, family, model_args.vocab_size)
    estimate = None
    if memory:
        dtype = param_dtype(config, device)
        estimate = check_memory(model_args, config, world_size, local_world_size, dtype, target)
    check_files(config, tokenizer)
    return Plan(parallel_dims, batch, tokenizer, family, model_args, estimate)


def check_stage_targets(meta, config: JobConfig, pp: int, targets: dict) -> None:
    """Every pipeline stage must hold a LoRA target (a stage with nothing to train has no
    optimizer to build): Qwen3.5's first stage may hold only linear-attention layers, without
    `wq`. Raises ConfigError naming the stage, its modules and the targets."""
    from titanlab.distributed.pipeline import all_stage_fqns

    for sid, fqns in enumerate(all_stage_fqns(meta, config, pp)):
        if not any(name == f or name.startswith(f + ".") for name in targets for f in fqns):
            raise ConfigError(
                f"peft.target_modules {list(config.peft.target_modules)} adapt no Linear of "
                f"pipeline stage {sid} ({' '.join(fqns)}) of model.name={config.model.name}: "
                "a stage needs a target to train; add targets every stage holds (e.g. wo, w2) "
                "or change parallelism.pipeline_parallel_degree"
            )


def check_files(config: JobConfig, tokenizer: AnyTokenizer) -> None:
    """What the run will read and write, checked without writing anything: the dataset folder
    (metadata parses, every shard has the length it lists, its vocabulary fits the tokenizer),
    that `job.dump_folder` can be created or written, and that `checkpoint.initial_load_path`
    and `checkpoint.load_step` name complete checkpoints. Raises ConfigError."""
    if config.data.dataset_path or config.data.sources:
        build_data(config, tokenizer)
    dump = os.path.abspath(config.job.dump_folder)
    existing = dump
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(existing) else "is not writable"
        raise ConfigError(
            f"job.dump_folder={config.job.dump_folder!r} cannot be written: "
            f"{existing} {what}; choose a folder you can write"
        )
    ckpt = config.checkpoint
    root = store.checkpoint_root(ckpt.folder, config.job.dump_folder)
    # initial_load_path is read only by a run with checkpointing on and none of its own yet.
    if (
        ckpt.enable
        and ckpt.initial_load_path
        and not ckpt.create_seed_checkpoint
        and ckpt.load_step < 0
        and not store.complete_steps(root)
    ):
        reason = (
            store.incomplete_reason(ckpt.initial_load_path)
            if os.path.isdir(ckpt.initial_load_path)
            else "it does not exist"
        )
        if reason:
            raise ConfigError(
                f"checkpoint.initial_load_path={ckpt.initial_load_path!r} cannot be "
                f"loaded: {reason}"
            )
    if ckpt.enable and ckpt.load_step >= 0 and not ckpt.create_seed_checkpoint:
        store.load_step_path(root, ckpt.load_step)
