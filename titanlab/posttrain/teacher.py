"""The teacher of a distillation run (`[distill]`): built, sharded like the student and loaded
from `distill.teacher_path`, forward only."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlab.config.performance import fused_loss
from titanlab.checkpoint import store
from titanlab.components.fused_head import use_fused_loss
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.models.common.decoder import Decoder
from titanlab.models.registry import build_model, get_flavor
from titanlab.models.stored_args import read_model_args

logger = logging.getLogger(__name__)


def teacher_args(config: JobConfig, family: Any, student_vocab: int) -> Any:
    """The teacher's model args: `distill.teacher_flavor` of the student's family, else the
    args stored in the teacher folder's model_args.json.

    Raises:
        ConfigError: one line — a missing or incomplete folder, no args to build it from, or a
            vocabulary other than the student's.
    """
    d = config.distill
    path = d.teacher_path
    reason = store.incomplete_reason(path) if os.path.isdir(path) else "it does not exist"
    if reason:
        raise ConfigError(f"distill.teacher_path={path!r} cannot be loaded: {reason}")
    if d.teacher_flavor:
        try:
            args = get_flavor(family, d.teacher_flavor)
        except ValueError as e:
            raise ConfigError(f"distill.teacher_flavor: {e}") from None
        args = dataclasses.replace(args, vocab_size=student_vocab)
    else:
        stored = read_model_args(path)
        if stored is None:
            raise ConfigError(
                f"distill.teacher_path={path!r} has no model_args.json; set distill.teacher_flavor"
            )
        args = stored[2]
    if args.vocab_size != student_vocab:
        raise ConfigError(
            f"distill.teacher_path={path!r} has a vocabulary of {args.vocab_size} tokens but "
            f"the student's is {student_vocab}; distillation needs the same tokenizer"
        )
    return dataclasses.replace(args, max_seq_len=config.training.seq_len)


def build_teacher(config: JobConfig, args: Any, device: torch.device, parallelize) -> nn.Module:
    """The teacher of `args`, parallelized with `parallelize` (the student's function, without
    activation checkpointing or compile), loaded from `distill.teacher_path`, in eval mode with
    no parameter requiring grad; on the meta `device` (a dry run) its weights are not read."""
    with torch.device("meta"):
        teacher = cast(Decoder, build_model(args))
    if fused_loss(config):  # the student's loss reads its hidden states
        use_fused_loss(teacher, config.loss.chunk_size)
    plain = dataclasses.replace(
        config,
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="none"),
        compile=dataclasses.replace(config.compile, enable=False),
    )
    parallelize(teacher, config=plain)
    teacher.to_empty(device=device)
    teacher.reset_rope(device)
    state = {"model": get_model_state_dict(teacher)}
    keys = store.saved_keys(config.distill.teacher_path)
    absent = [k for k in state["model"] if f"model.{k}" not in keys]
    if absent:
        raise ConfigError(
            f"distill.teacher_path={config.distill.teacher_path!r} holds no model.{absent[0]}; "
            "it is not a checkpoint of the teacher's shape"
        )
    if device.type != "meta":  # a dry run checks the stored names and reads no weight
        dcp.load(state, checkpoint_id=config.distill.teacher_path)
        set_model_state_dict(teacher, state["model"])
        logger.info("distill: teacher loaded from %s", config.distill.teacher_path)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def join_teacher_load(config: JobConfig) -> None:
    """On a rank that holds no teacher (a pipeline rank without the last stage): take part in
    the collective `dcp.load` of `build_teacher`, reading nothing."""
    dcp.load({}, checkpoint_id=config.distill.teacher_path)
