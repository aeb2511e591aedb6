"""Builders the trainer calls: tokenizer, model args, batch layout, data, model and its weights.

Nothing here runs a training step; `titanlab.trainer.trainer` composes these into the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.digit_tasks import DigitVocab
from titanlab.distributed.local_params import local_parameters
from titanlab.data.tokenizer import AnyTokenizer, default_tokenizer_path, load_tokenizer
from titanlab.models.common.decoder import Decoder
from titanlab.models.common.init import random_weights_skipped
from titanlab.models.common.shortened import shortened
from titanlab.models.registry import (
    ModelFamily,
    build_model,
    family_of_hf_config,
    get_family,
    get_flavor,
    same_architecture,
)
from titanlab.models.stored_args import HF_FLAVOR, read_model_args
from titanlab.peft.qlora import hide_quantized, is_quantized

logger = logging.getLogger(__name__)


def build_tokenizer(config: JobConfig) -> AnyTokenizer:
    """The tokenizer at `model.tokenizer_path` (tiktoken `tokenizer.model` or HF
    `tokenizer.json`), or the bundled stdlib BPE when it is empty; a reinforcement-learning or
    preference run on a digit task (no `rl.data_path`) uses the task's own vocabulary
    (`titanlab.data.digit_tasks`)."""
    if config.rl.algorithm != "none" and not config.rl.data_path:
        return cast(AnyTokenizer, DigitVocab())  # duck-typed: the ids and names the trainer reads
    path = config.model.tokenizer_path or default_tokenizer_path()
    try:
        return load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path={path!r}: {e}") from None


def build_family(config: JobConfig) -> ModelFamily:
    """The registered family `model.name`. Raises ConfigError naming the valid names."""
    try:
        return get_family(config.model.name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _hf_config_args(config: JobConfig, family: ModelFamily) -> Any:
    """Args of the `config.json` at `model.hf_config` (a file or the folder holding it)."""
    path = config.model.hf_config
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    expected = "give a Hugging Face config.json or the folder holding it"
    if not os.path.exists(path):
        raise ConfigError(f"model.hf_config={path!r} does not exist; {expected}")
    if not os.path.isfile(file):
        raise ConfigError(f"model.hf_config={path!r} is a folder without a config.json; {expected}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
        found = family_of_hf_config(cfg)
        if found.name != family.name:
            raise ValueError(f"it describes a {found.name} model but model.name={family.name!r}")
        return family.hf.from_config(cfg)
    except (OSError, json.JSONDecodeError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.hf_config={path!r}: {e}") from None


def _stored_args(config: JobConfig, family: ModelFamily) -> tuple[str, Any] | None:
    """(flavor, args) stored with `checkpoint.initial_load_path`, checked against model.name."""
    path = config.checkpoint.initial_load_path
    if not path or not os.path.isdir(path):
        return None
    try:
        stored = read_model_args(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None
    if stored is None:
        return None
    found, flavor, args = stored
    if found.name != family.name:
        raise ConfigError(
            f"checkpoint.initial_load_path={path!r} holds a {found.name} model; set "
            f"model.name={found.name!r} (model.name={family.name!r})"
        )
    return flavor, args


def build_model_args(config: JobConfig, vocab_size: int) -> Any:
    """The model's args for training: `model_architecture` with the RoPE table sized to
    `training.seq_len` (under context parallel the table is split with the sequence).

    Raises:
        ConfigError: as `model_architecture`.
    """
    args = model_architecture(config, vocab_size)
    return _validated(config, dataclasses.replace(args, max_seq_len=config.training.seq_len))


def context_length(config: JobConfig, vocab_size: int) -> int:
    """The longest sequence the trained model serves, in tokens: its architecture's context
    length (the flavor's, or the imported config.json's `max_position_embeddings`), or
    `training.seq_len` when that is longer. Checkpoints and exports record this, not the
    training length: RoPE and the weights serve any position up to it."""
    return max(model_architecture(config, vocab_size).max_seq_len, config.training.seq_len)


def model_architecture(config: JobConfig, vocab_size: int) -> Any:
    """The model's args with its own context length (`max_seq_len`): a published flavor with
    the tokenizer's vocab, or with `model.flavor = "hf"` the architecture of `model.hf_config`
    or of the args stored with `checkpoint.initial_load_path` (its own vocab size, which must
    hold the tokenizer's ids).

    Raises:
        ConfigError: unknown family or flavor, an unreadable or foreign config, a flavor that
            differs from the stored checkpoint's, or a vocabulary that does not fit.
    """
    family = build_family(config)
    flavor = config.model.flavor
    stored = _stored_args(config, family)
    if stored is not None and flavor not in (HF_FLAVOR, stored[0]):
        _check_stored_shape(config, family, flavor, stored)
        stored = (flavor, stored[1])  # the flavor's shape: the stored one, with its own vocab
    if flavor == HF_FLAVOR or (stored is not None and stored[0] == flavor):
        # The stored shape keeps the checkpoint's own vocab size (e.g. Qwen3's padded 151,936).
        if flavor == HF_FLAVOR and config.model.hf_config:
            args = _hf_config_args(config, family)
        elif stored is not None:
            args = stored[1]
        else:
            raise ConfigError(
                'model.flavor="hf" needs model.hf_config (a config.json) or a '
                "checkpoint.initial_load_path holding model_args.json (convert_checkpoint "
                "from-hf writes it)"
            )
        if vocab_size > args.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab_size} ids but the model's vocab_size is "
                f"{args.vocab_size}; use the model's own tokenizer (model.tokenizer_path)"
            )
    else:
        try:
            published = get_flavor(family, flavor)
        except ValueError as e:
            raise ConfigError(f"{e}, or {HF_FLAVOR!r}") from None
        if config.comm.mode == "fake_backend" and published.vocab_size > vocab_size:
            # A dry run plans the published shape: the flavor's vocabulary, which the bundled
            # tokenizer's ids fit in (a real run takes the size of the tokenizer it is given).
            vocab_size = published.vocab_size
        args = dataclasses.replace(published, vocab_size=vocab_size)
    return _with_options(config, args)


def _with_options(config: JobConfig, args: Any) -> Any:
    """`args` with the config's MoE, MTP and depth options applied, validated."""
    return _validated(
        config, _with_depth(config, _with_mtp_options(config, _with_moe_options(config, args)))
    )


def _check_stored_shape(
    config: JobConfig, family: ModelFamily, flavor: str, stored: tuple[str, Any]
) -> None:
    """A checkpoint stored under another flavor name than `flavor` (a run of a flavor's first
    blocks, `model.n_layers`, stores "hf") loads when `flavor` with the config's options is its
    architecture (`same_architecture`); ConfigError naming the stored flavor otherwise."""
    try:
        ours = _with_options(
            config, dataclasses.replace(get_flavor(family, flavor), vocab_size=stored[1].vocab_size)
        )
    except (ValueError, ConfigError):
        ours = None  # an unknown flavor or options that do not apply: not the stored shape
    if ours is None or not same_architecture(family, ours, stored[1]):
        raise ConfigError(
            f"checkpoint.initial_load_path={config.checkpoint.initial_load_path!r} holds a "
            f"{family.name} model of flavor {stored[0]!r}, not model.flavor={flavor!r}; set "
            f"model.flavor={stored[0]!r}"
        )


def _with_depth(config: JobConfig, args: Any) -> Any:
    """`args` with `model.n_layers` blocks (`shortened`); ConfigError beyond the model's own."""
    n = config.model.n_layers
    if n and n > args.n_layers:
        raise ConfigError(
            f"model.n_layers={n}: {config.model.name} {config.model.flavor} has "
            f"{args.n_layers} blocks; use 1..{args.n_layers}, or 0 for all"
        )
    return shortened(args, n) if n else args


def _validated(config: JobConfig, args: Any) -> Any:
    """`args` after `args.validate()`; its ValueError becomes a ConfigError naming the flavor."""
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model.flavor={config.model.flavor}: {e}") from None
    return args


def _with_mtp_options(config: JobConfig, args: Any) -> Any:
    """`args` with `model.mtp_loss_weight` applied (a value >= 0 replaces the flavor's). Raises
    ConfigError for a model without multi-token prediction depths given it."""
    weight = config.model.mtp_loss_weight
    if weight < 0:
        return args
    if not getattr(args, "mtp_layers", 0):
        raise ConfigError(
            f"model.mtp_loss_weight={weight} needs a model with multi-token prediction depths; "
            f"model.name={config.model.name} flavor {config.model.flavor} has none"
        )
    return dataclasses.replace(args, mtp_loss_weight=weight)


def _with_moe_options(config: JobConfig, args: Any) -> Any:
    """`args` with `model.moe_load_balance_coeff` / `model.moe_bias_update_speed` (values >= 0)
    and `model.moe_load_balance_type` (non-empty) replacing the flavor's. Raises ConfigError
    for a dense model given any."""
    m = config.model
    change: dict[str, Any] = {
        field: value
        for field, value in (
            ("load_balance_coeff", m.moe_load_balance_coeff),
            ("bias_update_speed", m.moe_bias_update_speed),
        )
        if value >= 0
    }
    if m.moe_load_balance_type:
        change["load_balance_type"] = m.moe_load_balance_type
    if not change:
        return args
    if not hasattr(args, "moe"):
        raise ConfigError(f"model.moe_* options need an MoE model; model.name={m.name!r} is dense")
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **change))


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


def build_meta_model(model_args: Any) -> Decoder:
    """The model of `model_args` (its family's) on the meta device: shapes only, no memory;
    parallelize it, then materialize."""
    with torch.device("meta"):
        return cast(Decoder, build_model(model_args))


def _local_shards(full: torch.Tensor, like: Any) -> torch.Tensor:
    """`full` cut as `like` is sharded, from this rank's own copy (no collective), or `full`
    itself when `like` is not a DTensor."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


@torch.no_grad()
def init_model_weights(
    model_parts: list[nn.Module],
    model_args: Any,
    device: torch.device,
    seed: int,
    world_size: int,
    weights_loaded: bool = False,
) -> None:
    """Materialized (`to_empty`) model parts → initialized weights, deterministic for `seed`.

    `weights_loaded`: a checkpoint that holds every weight loads next
    (`CheckpointLoading.loads_every_weight`), so nothing is drawn: only the buffers and the
    constant weights are set. Either way the global random generator is left seeded with `seed`
    (what LoRA dropout draws from), so a run starts alike whether it drew its weights or not.

    On CUDA, DTensor's offset-based RNG gives each shard its own slice of one random stream, so
    `init_weights` runs on the sharded parts directly (pipeline stages then differ from a
    single-stage init: start every layout from a seed checkpoint to compare them). CPU
    generators have no such offsets (every shard would draw the same numbers), so on CPU each
    rank initializes a full copy and loads its own parts and shards from it (each rank cuts
    its shards locally, no collective): the weights then equal a single-process
    run's for the same seed, whatever the layout. CPU runs use small models, so the full copy
    is cheap. The parts' own `init_weights` then runs on their local shards
    (`local_parameters`) with its random draws skipped (`random_weights_skipped`): it sets
    their buffers (RoPE tables, MoE counters), and the parameters are replaced.
    """
    torch.manual_seed(seed)
    # Drawn on the parts themselves (CUDA, or one process), or, on CPU ranks, cut from a full
    # copy drawn below; not at all when a checkpoint replaces every weight.
    on_parts = device.type == "cuda" or world_size == 1
    skip_draws = weights_loaded or not on_parts
    # Where the parts draw nothing, only their buffers and constant weights are set, on their
    # local tensors (the buffers as they are), skipping DTensor's dispatch.
    # QLoRA's NF4 base weights are hidden first: they come from the checkpoint.
    with hide_quantized(model_parts), contextlib.ExitStack() as local:
        if skip_draws:
            local.enter_context(local_parameters(model_parts))
            local.enter_context(random_weights_skipped())
        for part in model_parts:
            cast(Decoder, part).init_weights(buffer_device=device)
    if not weights_loaded and not on_parts:
        _load_full_copy(model_parts, model_args, seed)
    torch.manual_seed(seed)


def _load_full_copy(model_parts: list[nn.Module], model_args: Any, seed: int) -> None:
    """Each CPU rank draws the whole model for `seed` and loads its own parts and shards of it."""
    full = build_meta_model(model_args)
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    full.init_weights()
    full_sd = full.state_dict()
    for part in model_parts:
        sd = get_model_state_dict(part)
        # Weights the plain model lacks (LoRA adapters) are initialized by their own code;
        # QLoRA's NF4 weights are left as they are.
        keys = [k for k, v in sd.items() if not is_quantized(v)]
        extra = [k for k in keys if k not in full_sd]
        # Every rank holds the same full copy, so each cuts its own shards from it
        # (`src_data_rank=None`); a full state dict would scatter each tensor from rank 0.
        shards: dict[str, Any] = {k: _local_shards(full_sd[k], sd[k]) for k in keys if k in full_sd}
        set_model_state_dict(
            part, shards, options=StateDictOptions(strict=not extra and len(keys) == len(sd))
        )
