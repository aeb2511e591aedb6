"""The run's data from its config: the train and held-out datasets (one prepared folder, the
default corpus, or a weighted mixture of folders), the mixture's schedule, document masking and
the data loaders. Every problem is a `ConfigError` of one line, raised by the pre-flight check
before any process starts."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.dataset import MemmapTokenDataset
from titanlab.data.default_corpus import default_cache_dir, ensure_default_corpus
from titanlab.data.document_masking import DocumentMasking, first_eos_offset
from titanlab.data.loader import build_dataloader
from titanlab.data.mixture import MixtureDataset, WeightSchedule
from titanlab.data.sft_dataset import PackedChatDataset, is_chat_folder
from titanlab.data.tokenizer import AnyTokenizer


@dataclass
class TrainingData:
    """train / val: datasets of (input_ids, labels) windows (a `MixtureDataset` for several
    sources; val None without held-out data); schedule: the mixture's weights per step (None
    for one source); masking: document masking or None; description: for the log."""

    train: Any
    val: Any
    schedule: WeightSchedule | None
    masking: DocumentMasking | None
    description: str


def dataset_dir(config: JobConfig, tokenizer_path: str) -> str:
    """`data.dataset_path`, or the default corpus prepared (once, under a file lock) in the cache."""
    if config.data.dataset_path:
        if not os.path.isdir(config.data.dataset_path):
            raise ConfigError(
                f"data.dataset_path={config.data.dataset_path!r} is not a directory; "
                "make one with `titanlab prepare-data`"
            )
        return config.data.dataset_path
    return ensure_default_corpus(config.data.cache_dir or default_cache_dir(), tokenizer_path)


def _open_folder(
    config: JobConfig, tokenizer: AnyTokenizer, data_dir: str, option: str
) -> tuple[MemmapTokenDataset, MemmapTokenDataset | None]:
    """(train, val-or-None) of one prepared folder, checked against the tokenizer; `option`
    names the config key in messages."""
    if not os.path.isdir(data_dir):
        raise ConfigError(
            f"{option}={data_dir!r} is not a directory; make one with `titanlab prepare-data`"
        )
    seq, fraction = config.training.seq_len, config.data.val_fraction
    try:
        if is_chat_folder(data_dir):
            kind: Any = functools.partial(PackedChatDataset, packing=config.data.packing)
        else:
            kind = MemmapTokenDataset
        train = kind(data_dir, seq, split="train", val_fraction=fraction)
        val = kind(data_dir, seq, split="val", val_fraction=fraction) if fraction > 0 else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{option}={data_dir!r}: {e}") from None
    fingerprint = train.metadata.get("tokenizer_fingerprint")
    if fingerprint and fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"{option}={data_dir!r} was tokenized with tokenizer {fingerprint}"
            f" but model.tokenizer_path is {tokenizer.fingerprint}; prepare it again"
        )
    vocab = train.metadata.get("vocab_size")
    if vocab is not None and vocab > tokenizer.vocab_size:
        raise ConfigError(
            f"{option}={data_dir!r} has token ids up to vocab_size={vocab},"
            f" more than the tokenizer's {tokenizer.vocab_size}; prepare it again "
            "with model.tokenizer_path"
        )
    masking = document_masking(config, train, tokenizer)
    chat = isinstance(train, PackedChatDataset)
    if masking is not None and not chat and first_eos_offset(train, masking.eos_id) is None:
        raise ConfigError(
            f"data.document_mask=true but {option}={data_dir!r} has no EOS token "
            f"(id {masking.eos_id}) in its first {min(train.total_tokens, 1 << 24):,} tokens, "
            "so no document boundaries; prepare it with `titanlab prepare-data` (which ends "
            "every document with EOS) or set data.document_mask=false"
        )
    return train, val


def source_names(config: JobConfig) -> list[str]:
    """Each `[[data.sources]]` table's name (default: its folder's name).

    Raises:
        ConfigError: two sources end up with the same name.
    """
    names = [
        s.name or os.path.basename(os.path.normpath(s.path)) or s.path for s in config.data.sources
    ]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(
                f"data.sources[{i}] is named {name!r} like an earlier source; give each a "
                "distinct name (name = ...)"
            )
    return names


def build_data(config: JobConfig, tokenizer: AnyTokenizer) -> TrainingData:
    """The datasets of `config` (see the module docstring). Raises ConfigError (one line)."""
    if not config.data.sources:
        data_dir = dataset_dir(config, tokenizer.path)
        one, one_val = _open_folder(config, tokenizer, data_dir, "data.dataset_path")
        about = data_dir
        if isinstance(one, PackedChatDataset):
            about = (
                f"{data_dir} (chat SFT, {'packed' if config.data.packing else 'one sample per window'}"
                f", {one.truncated} samples cut to seq_len)"
            )
        return TrainingData(one, one_val, None, document_masking(config, one, tokenizer), about)
    names = source_names(config)
    opened = [
        _open_folder(config, tokenizer, s.path, f"data.sources[{i}].path")
        for i, s in enumerate(config.data.sources)
    ]
    eos = {o[0].metadata.get("eos_id") for o in opened}
    if len(eos) > 1:
        raise ConfigError(
            f"data.sources end documents with different EOS ids {sorted(map(str, eos))}; "
            "prepare them with the same tokenizer"
        )
    train = MixtureDataset([t for t, _ in opened], names)
    val: MixtureDataset | None = None
    if all(v is not None for _, v in opened):
        val = MixtureDataset([v for _, v in opened], names)
    schedule = WeightSchedule(
        [s.weight for s in config.data.sources],
        [(p.step, p.weights) for p in config.data.schedule],
    )
    parts = ", ".join(f"{n} ({len(t):,} windows)" for n, (t, _) in zip(names, opened))
    masking = document_masking(config, opened[0][0], tokenizer)
    return TrainingData(train, val, schedule, masking, f"mixture of {parts}")


def document_masking(config: JobConfig, train, tokenizer: AnyTokenizer) -> DocumentMasking | None:
    """The run's document masking (the data's EOS id, else the tokenizer's), or None when
    `data.document_mask` is off. Packed chat SFT data always gets it, with restarted
    positions: its samples must not see each other."""
    packed_chat = isinstance(train, PackedChatDataset) and config.data.packing
    if not (config.data.document_mask or packed_chat):
        return None
    eos = train.metadata.get("eos_id")
    return DocumentMasking(
        eos_id=int(eos) if eos is not None else tokenizer.eos_id,
        reset_positions=config.data.reset_positions or packed_chat,
    )


def build_loader(
    dataset,
    config: JobConfig,
    dp_rank: int,
    dp_degree: int,
    samples_per_step: int = 1,
    schedule: WeightSchedule | None = None,
):
    """This rank's endless, resumable loader over `dataset` (`build_dataloader`)."""
    return build_dataloader(
        dataset,
        local_batch_size=config.training.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_degree,
        seed=config.debug.seed,
        num_workers=config.data.num_workers,
        samples_per_step=samples_per_step,
        schedule=schedule,
    )
