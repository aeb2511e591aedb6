"""The `[data]` section: what the run reads, mixtures of datasets, their schedule and document
masking. `[[data.sources]]` and `[[data.schedule]]` are TOML arrays of tables (each table one
`DataSource` / `SchedulePoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlab.config.errors import _require


@dataclass
class DataSource:
    """One dataset of a mixture: a `[[data.sources]]` table."""

    path: str = ""
    """Folder of token shards made by `tools/prepare_data.py`."""

    weight: float = 1.0
    """Share of the samples this source supplies (the weights are normalized to sum to 1)."""

    name: str = ""
    """Name in logs, metrics and checkpoints (default: the folder's name)."""


@dataclass
class SchedulePoint:
    """One point of a curriculum: a `[[data.schedule]]` table."""

    step: int = 0
    """Training step at which the mixture has exactly these weights."""

    weights: list[float] = field(default_factory=list)
    """One weight per source, in the order of `[[data.sources]]` (normalized to sum to 1)."""


def _check_weights(weights: list[float], where: str) -> None:
    _require(
        all(w >= 0 for w in weights) and sum(weights) > 0,
        f"{where}={weights} must be >= 0 and not all 0",
    )


@dataclass
class Data:
    dataset_path: str = ""
    """Folder of token shards made by `tools/prepare_data.py` (with metadata.json). Empty: the
    Python standard library's .py files, prepared into the cache on first use (or the
    `sources` when given)."""

    sources: list[DataSource] = field(default_factory=list)
    """A mixture of prepared folders, sampled by weight: `[[data.sources]]` tables of `path`,
    `weight` and `name` (see docs/data.md). Each sample comes from one source; the shares follow
    the weights exactly (the source furthest below its share supplies the next sample), each
    source is shuffled per epoch without replacement. Empty: `dataset_path` alone."""

    schedule: list[SchedulePoint] = field(default_factory=list)
    """Curriculum over the `sources`: `[[data.schedule]]` tables of `step` and `weights`,
    sorted by step; the weights are linear in the step between points and constant before the
    first and after the last. Two points one step apart switch phases. Empty: the sources'
    weights throughout."""

    cache_dir: str = ""
    """Where the default corpus is prepared. Empty: $TITANLAB_CACHE or ~/.cache/titanlab."""

    val_fraction: float = 0.005
    """Fraction of the token windows held out for validation (taken from the end of the data;
    of each source in a mixture)."""

    num_workers: int = 0
    """Data loader worker processes per rank (0: load in the training process)."""

    document_mask: bool = False
    """Keep attention inside each document of a window (documents end with the data's EOS
    token): block-causal attention, and no next-token target across a document boundary
    (flex attention on CUDA, SDPA with an explicit mask elsewhere). A document longer than
    the window is split at the window's edge: each piece trains as its own document. Under
    context parallel the mask runs through titanlab's CP attention (ring or Ulysses, the
    tokens dealt by `parallelism.context_parallel_load_balancer`)."""

    reset_positions: bool = False
    """With document_mask: restart the RoPE positions at 0 at each document's first token."""

    packing: bool = True
    """Chat SFT data (`tools/prepare_data.py --format chat`): pack several samples into each
    window, never splitting one, with document masking and restarted positions always on (each
    sample attends only to itself). false: one sample per window, padded."""

    def validate(self) -> None:
        _require(
            0.0 <= self.val_fraction < 1.0,
            f"data.val_fraction={self.val_fraction} must be in [0, 1)",
        )
        _require(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        _require(
            self.document_mask or not self.reset_positions,
            "data.reset_positions=true needs data.document_mask=true",
        )
        _require(
            not (self.sources and self.dataset_path),
            "data.dataset_path and data.sources are both set; give one (a single source is "
            "[[data.sources]] with one table)",
        )
        for i, src in enumerate(self.sources):
            _require(bool(src.path), f"data.sources[{i}].path is empty; give a prepared folder")
            _require(src.weight >= 0, f"data.sources[{i}].weight={src.weight} must be >= 0")
        if self.sources:
            _check_weights([s.weight for s in self.sources], "data.sources weights")
        names = [s.name for s in self.sources if s.name]
        _require(len(names) == len(set(names)), f"data.sources names {names} repeat a name")
        _require(
            not self.schedule or bool(self.sources),
            "data.schedule needs [[data.sources]] (the weights it moves are theirs)",
        )
        for i, point in enumerate(self.schedule):
            _require(point.step >= 0, f"data.schedule[{i}].step={point.step} must be >= 0")
            _require(
                len(point.weights) == len(self.sources),
                f"data.schedule[{i}].weights has {len(point.weights)} values for "
                f"{len(self.sources)} sources",
            )
            _check_weights(point.weights, f"data.schedule[{i}].weights")
            if i:
                prev = self.schedule[i - 1].step
                _require(
                    point.step > prev,
                    f"data.schedule is not sorted by step: step {point.step} (point {i}) after "
                    f"step {prev}; list the points in increasing step order",
                )
