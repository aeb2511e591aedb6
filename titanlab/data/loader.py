"""Resumable data-parallel batches of token windows."""

from __future__ import annotations

from collections.abc import Sized
from typing import cast
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlab.data.mixture import MixtureDataset, MixtureSampler, WeightSchedule


def collate_windows(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(input_ids, labels)`` pairs of shape (seq,) into a pair of shape (batch, seq)."""
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


def build_dataloader(
    dataset: Dataset,
    *,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    num_workers: int = 0,
    samples_per_step: int = 1,
    schedule: WeightSchedule | None = None,
) -> StatefulDataLoader:
    """An endless loader of this rank's batches, resumable with ``state_dict``/``load_state_dict``.

    Each item is ``(input_ids, labels)``, both int64 of shape ``(local_batch_size, seq_len)``.
    Indices come from a :class:`MixtureSampler`: one global stream of samples that rank r of W
    takes every W-th position of (each source reshuffled every epoch, disjoint across ranks;
    the sources of a :class:`MixtureDataset` mixed by `schedule`). Memory is pinned only when
    CUDA is available.

    Args:
        dataset: a map-style dataset of ``(input_ids, labels)`` pairs, e.g. ``MemmapTokenDataset``,
            or a ``MixtureDataset`` of several.
        local_batch_size: samples per batch on this rank.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world_size: number of data-parallel ranks.
        seed: shuffling seed, the same on every rank.
        num_workers: loader worker processes (0 = load in the main process).
        samples_per_step: samples of one global batch (the schedule's unit of time).
        schedule: weights of a MixtureDataset's sources per step (default: equal).

    Raises:
        ValueError: ``local_batch_size < 1``, ``num_workers < 0``, or a bad rank/world size
            (see :class:`MixtureSampler`).
    """
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size={local_batch_size} is invalid; use an integer >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} is invalid; use an integer >= 0")
    if isinstance(dataset, MixtureDataset):
        sizes, names = dataset.sizes, dataset.names
    else:
        sizes, names = [len(cast(Sized, dataset))], None
    sampler = MixtureSampler(
        sizes,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        samples_per_step=samples_per_step,
        schedule=schedule,
        names=names,
    )
    return StatefulDataLoader(
        dataset,
        batch_size=local_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        collate_fn=collate_windows,
        pin_memory=torch.cuda.is_available(),
    )
