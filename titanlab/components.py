"""Builders the trainer calls: tokenizer, model args, batch layout, data, model and its weights.

Nothing here runs a training step; `titanlab.train` composes these into the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.dataset import MemmapTokenDataset
from titanlab.data.default_corpus import default_cache_dir, ensure_default_corpus
from titanlab.data.loader import build_dataloader
from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path
from titanlab.models.llama3 import Transformer, TransformerModelArgs, llama3_flavors

logger = logging.getLogger(__name__)


def build_tokenizer(config: JobConfig) -> Tokenizer:
    """The tokenizer at `model.tokenizer_path`, or the bundled stdlib BPE when it is empty."""
    path = config.model.tokenizer_path or default_tokenizer_path()
    try:
        return Tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path={path!r}: {e}") from None


def build_model_args(config: JobConfig, vocab_size: int) -> TransformerModelArgs:
    """The flavor's published dims with the tokenizer's vocab and the training seq_len."""
    args = dataclasses.replace(
        llama3_flavors[config.model.flavor],
        vocab_size=vocab_size,
        max_seq_len=config.training.seq_len,
    )
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model.flavor={config.model.flavor}: {e}") from None
    return args


@dataclasses.dataclass
class BatchLayout:
    """How a global batch splits: `global = local × dp_degree × grad_accum_steps` samples."""

    local_batch_size: int
    global_batch_size: int
    dp_degree: int
    grad_accum_steps: int


def batch_layout(config: JobConfig, dp_degree: int) -> BatchLayout:
    """Resolve `training.global_batch_size` (-1: local × dp) and the accumulation steps.

    Raises ConfigError when the global batch is not a multiple of local × dp.
    """
    local = config.training.local_batch_size
    per_step = local * dp_degree
    global_bs = config.training.global_batch_size
    if global_bs == -1:
        global_bs = per_step
    if global_bs % per_step:
        raise ConfigError(
            f"training.global_batch_size={global_bs} is not divisible by local_batch_size × dp "
            f"= {local} × {dp_degree} = {per_step}; use a multiple of {per_step}"
        )
    return BatchLayout(local, global_bs, dp_degree, global_bs // per_step)


def dataset_dir(config: JobConfig, tokenizer_path: str) -> str:
    """`data.dataset_path`, or the default corpus prepared (once, under a file lock) in the cache."""
    if config.data.dataset_path:
        if not os.path.isdir(config.data.dataset_path):
            raise ConfigError(
                f"data.dataset_path={config.data.dataset_path!r} is not a directory; "
                "make one with tools/prepare_data.py"
            )
        return config.data.dataset_path
    return ensure_default_corpus(config.data.cache_dir or default_cache_dir(), tokenizer_path)


def build_datasets(config: JobConfig, tokenizer: Tokenizer, data_dir: str):
    """(train, val-or-None) MemmapTokenDatasets; the data must be tokenized with `tokenizer`."""
    try:
        train = MemmapTokenDataset(
            data_dir, config.training.seq_len, split="train", val_fraction=config.data.val_fraction
        )
        val = None
        if config.data.val_fraction > 0:
            val = MemmapTokenDataset(
                data_dir,
                config.training.seq_len,
                split="val",
                val_fraction=config.data.val_fraction,
            )
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.dataset_path={data_dir!r}: {e}") from None
    fingerprint = train.metadata.get("tokenizer_fingerprint")
    if fingerprint and fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"data.dataset_path={data_dir!r} was tokenized with tokenizer {fingerprint}"
            f" but model.tokenizer_path is {tokenizer.fingerprint}; prepare it again"
        )
    vocab = train.metadata.get("vocab_size")
    if vocab is not None and vocab > tokenizer.vocab_size:
        raise ConfigError(
            f"data.dataset_path={data_dir!r} has token ids up to vocab_size={vocab},"
            f" more than the tokenizer's {tokenizer.vocab_size}; prepare it again "
            "with model.tokenizer_path"
        )
    return train, val


def build_loader(dataset, config: JobConfig, dp_rank: int, dp_degree: int):
    return build_dataloader(
        dataset,
        local_batch_size=config.training.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_degree,
        seed=config.debug.seed,
        num_workers=config.data.num_workers,
    )


def build_meta_model(model_args: TransformerModelArgs) -> Transformer:
    """The model on the meta device: shapes only, no memory; parallelize it, then materialize."""
    with torch.device("meta"):
        return Transformer(model_args)


@torch.no_grad()
def init_model_weights(
    model_parts: list[nn.Module],
    model_args: TransformerModelArgs,
    device: torch.device,
    seed: int,
    world_size: int,
) -> None:
    """Materialized (`to_empty`) model parts → initialized weights, deterministic for `seed`.

    On CUDA, DTensor's offset-based RNG gives each shard its own slice of one random stream, so
    `init_weights` runs on the sharded parts directly (pipeline stages then differ from a
    single-stage init: start every layout from a seed checkpoint to compare them). CPU
    generators have no such offsets (every shard would draw the same numbers), so on CPU each
    rank initializes a full copy and loads its own parts and shards from it
    (`set_model_state_dict(full_state_dict=True)`): the weights then equal a single-process
    run's for the same seed, whatever the layout. CPU runs use small models, so the full copy
    is cheap.
    """
    torch.manual_seed(seed)
    for part in model_parts:
        cast(Transformer, part).init_weights(buffer_device=device)
    if device.type == "cuda" or world_size == 1:
        return
    full = build_meta_model(model_args)
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    full.init_weights()
    full_sd = full.state_dict()
    for part in model_parts:
        keys = get_model_state_dict(part).keys()
        set_model_state_dict(
            part, {k: full_sd[k] for k in keys}, options=StateDictOptions(full_state_dict=True)
        )
