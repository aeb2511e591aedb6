"""The frozen reference policy of the KL term and of DPO: the run's initial model, sharded like
the policy; with LoRA, the policy module itself with its adapters off (no second model)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlab.config.performance import fused_loss
from titanlab.checkpoint import store
from titanlab.components import builders as components
from titanlab.components.fused_head import use_fused_loss
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.peft.lora import adapters_disabled

logger = logging.getLogger(__name__)


def build_reference(
    config: JobConfig, model_args: Any, device: torch.device, parallelize, world_size: int
) -> nn.Module:
    """The initial model: the weights of `checkpoint.initial_load_path` when set, else the
    seeded initialization the policy starts from (`debug.seed`), so a resumed run rebuilds the
    same reference without storing it. Parallelized with the policy's `parallelize` (no
    activation checkpointing), every parameter frozen, in eval mode.

    Raises:
        ConfigError: `initial_load_path` holds no weights of this model's shape.
    """
    reference = components.build_meta_model(model_args)
    if fused_loss(config):  # the policy's head, for the same numbers
        use_fused_loss(reference, config.loss.chunk_size)
    plain = dataclasses.replace(
        config,
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="none"),
    )
    parallelize(reference, config=plain)
    reference.to_empty(device=device)
    components.init_model_weights([reference], model_args, device, config.debug.seed, world_size)
    path = config.checkpoint.initial_load_path
    if path:
        state = {"model": get_model_state_dict(reference)}
        keys = store.saved_keys(path)
        absent = [k for k in state["model"] if f"model.{k}" not in keys]
        if absent:
            raise ConfigError(
                f"checkpoint.initial_load_path={path!r} holds no model.{absent[0]}; the "
                "reference policy needs a checkpoint of this model's family and shape"
            )
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(reference, state["model"])
    for p in reference.parameters():
        p.requires_grad_(False)
    logger.info(
        "rl: reference policy = %s", path or f"the initial weights (seed {config.debug.seed})"
    )
    return reference.eval()


class AdaptersOff(nn.Module):
    """The base model of a LoRA policy as the reference: a forward of the policy module (the
    same sharded weights) inside `adapters_disabled`. With adapters starting at B = 0, this is
    exactly the initial policy, as a separate frozen copy would be, at no extra memory.

    Args:
        policy: the LoRA-adapted, parallelized policy (its adapters' `scaling` is set to 0 for
            the duration of each forward only).
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)
