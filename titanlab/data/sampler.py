"""Infinite, resumable, data-parallel shuffling sampler."""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class DistributedShuffleSampler(Sampler[int]):
    """Endless stream of sample indices for one data-parallel rank, epoch after epoch.

    Epoch ``e`` orders ``range(num_samples)`` by ``torch.randperm`` seeded with ``seed + e`` (or
    keeps it in order when ``shuffle=False``), drops the tail beyond a multiple of
    ``dp_world_size``, and gives rank ``r`` the positions ``r, r + W, r + 2W, ...``. Ranks are thus
    disjoint and together cover the epoch; each gets ``num_samples // dp_world_size`` indices.

    The sampler tracks how many indices its iterator has handed out; :meth:`state_dict` /
    :meth:`load_state_dict` save and restore that position, and a new iterator continues from it.
    torchdata's ``StatefulDataLoader`` calls them through its batch sampler, which makes resuming
    exact with any ``num_workers``.

    Args:
        num_samples: dataset length.
        dp_rank: this rank, in ``[0, dp_world_size)``.
        dp_world_size: number of data-parallel ranks.
        seed: base seed shared by all ranks.
        shuffle: permute each epoch; ``False`` walks indices in order.

    Raises:
        ValueError: ``dp_world_size < 1``, ``dp_rank`` out of range or
            ``num_samples < dp_world_size`` (a rank would get no samples).
    """

    def __init__(
        self, num_samples: int, *, dp_rank: int, dp_world_size: int, seed: int, shuffle: bool = True
    ):
        if dp_world_size < 1:
            raise ValueError(f"dp_world_size={dp_world_size} is invalid; use an integer >= 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} is invalid; use 0..{dp_world_size - 1}")
        if num_samples < dp_world_size:
            raise ValueError(
                f"num_samples={num_samples} is less than dp_world_size={dp_world_size}; "
                "every rank needs at least one sample"
            )
        super().__init__()
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.shuffle = shuffle
        self.samples_per_rank = num_samples // dp_world_size
        self.epoch = 0
        self.position = 0  # indices of this epoch already handed out
        self._cached: tuple[int, list[int]] | None = None

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's ``samples_per_rank`` indices of ``epoch``, in order."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            usable = self.samples_per_rank * self.dp_world_size
            self._cached = (epoch, order[self.dp_rank : usable : self.dp_world_size].tolist())
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        while True:
            if self.position >= self.samples_per_rank:
                self.epoch, self.position = self.epoch + 1, 0
            index = self.epoch_indices(self.epoch)[self.position]
            self.position += 1  # count it before yielding so state_dict() includes it
            yield index

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "num_samples", "dp_world_size", "seed"}`` (plain ints)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "dp_world_size": self.dp_world_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position.

        A state saved with another `dp_world_size` W (a checkpoint resharded to a new layout) is
        converted through the global position: W ranks that each took p indices of an epoch
        consumed its first p·W positions, so each of the W' ranks now resumes at p·W / W'. With
        the same global batch size, later global batches are then the same samples as before.

        Raises:
            ValueError: the dataset length or seed differ from the saved ones, or p·W is not a
                multiple of the new world size.
        """
        saved_world = int(state_dict["dp_world_size"])
        if saved_world != self.dp_world_size:
            consumed = int(state_dict["position"]) * saved_world
            if consumed % self.dp_world_size:
                raise ValueError(
                    f"sampler state of {saved_world} ranks at position {state_dict['position']} "
                    f"({consumed} samples) cannot be split over {self.dp_world_size} ranks"
                )
            state_dict = dict(
                state_dict,
                dp_world_size=self.dp_world_size,
                position=consumed // self.dp_world_size,
            )
        for key in ("num_samples", "dp_world_size", "seed"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state_dict[key]} but this sampler has "
                    f"{getattr(self, key)}; resume with the same data, dp size and seed"
                )
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
