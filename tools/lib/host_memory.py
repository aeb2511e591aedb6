"""Host memory of a training process, sampled between steps: what
`tools/benchmark_host_memory.py` and `tests/integration/test_host_memory.py` read.

A sample separates the four places a growing resident size can come from:
- Python objects: the objects the cyclic collector tracks (containers, instances; not ints or
  strings), counted by type, garbage included: the loop disables automatic collection and
  runs `gc.collect(1)` every `training.gc_freq` steps, so garbage that reached the oldest
  generation stays, and counts, until a full collection the loop never runs; `tracemalloc`'s
  traced bytes (every Python allocation since tracing started) and pymalloc's block count
  (`sys.getallocatedblocks`) see the untracked objects too, and the items that tracked lists,
  dicts, sets and deques hold see the commonest leak of a training loop, a float or an int
  appended to a history each step (the history is one tracked object; its length grows);
- torch's caches: the entries of DTensor's sharding-propagation cache (unbounded in torch 2.13;
  it stays flat when every step dispatches the same op schemas);
- the C allocator: glibc's heap in use and free (`mallinfo2`, over every arena). Memory in use
  that stays flat while the resident size grows is the allocator holding freed chunks it cannot
  reuse or hand back, not a leak; `malloc_trim(0)` returns what it can and shows how much that is;
- pages of files: the resident size counts file-backed pages (`RssFile`) beside anonymous memory
  (`RssAnon`, where the heaps live). The token shards are memory-mapped (`np.memmap`), so each
  page a batch reads stays resident until the kernel needs it back: that grows with the steps
  until the whole dataset is resident, and is page cache the kernel can drop, not a leak.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Collection
from typing import Any

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (mallinfo(3), glibc >= 2.33): sizes in bytes."""

    _NAMES = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _NAMES.split()]


def _libc() -> Any | None:
    """glibc with `mallinfo2` and `malloc_trim`, or None (another C library, an older glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def heap_mib() -> tuple[float, float]:
    """(in use, free) MiB of glibc's heap over every arena, mmap-ed blocks counted as in use;
    (nan, nan) without glibc's `mallinfo2`."""
    if _LIBC is None:
        return (float("nan"), float("nan"))
    m = _LIBC.mallinfo2()
    return ((m.uordblks + m.hblkhd) / MIB, m.fordblks / MIB)


def malloc_trim() -> bool:
    """Hand glibc's free heap memory back to the kernel (`malloc_trim(0)`); False without glibc."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


def status_mib() -> dict[str, float]:
    """`VmRSS`, `RssAnon` and `RssFile` of this process in MiB (Linux /proc/self/status)."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024  # kB
    return out


def mapped_data_mib() -> float:
    """Resident MiB of the files this process maps other than code (shared objects, the
    interpreter): here the memory-mapped token shards (/proc/self/smaps)."""
    exe = os.path.realpath(sys.executable)
    total_kb, counted = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:  # a mapping: range perms offset dev inode [path]
                path = head[5].strip() if len(head) > 5 else ""
                counted = (path.startswith("/") and not path.startswith("/dev/")
                           and ".so" not in os.path.basename(path) and path != exe)  # fmt: skip
            elif counted and head[0] == "Rss:":
                total_kb += int(head[1])
    return total_kb / 1024


def type_name(t: type) -> str:
    """`module.QualName` of a type (a type whose `__module__` is not a string: `?.QualName`),
    interned: the counts of two samples share their keys instead of adding a string per type."""
    module = t.__dict__.get("__module__", getattr(t, "__module__", "?"))
    return sys.intern(f"{module if isinstance(module, str) else '?'}.{t.__qualname__}")


def objects_by_type() -> collections.Counter[str]:
    """The objects the cyclic collector tracks, by `type_name`, live or not yet collected.

    Counted by hand: `Counter(iterable)` asks whether the iterable is a Mapping, and after any
    `ABCMeta.register` (an import) that question adds new entries to the ABCs' caches, which
    the next sample would count."""
    by_type: dict[type, int] = {}
    for o in gc.get_objects():
        t = type(o)
        by_type[t] = by_type.get(t, 0) + 1
    counts: collections.Counter[str] = collections.Counter()
    for t, n in by_type.items():
        counts[type_name(t)] += n
    return counts


_CONTAINERS = (list, dict, set, collections.deque)


def container_items() -> int:
    """The items held by the lists, dicts, sets and deques (their subclasses too) the cyclic
    collector tracks (a dict that holds atoms only is untracked, and is not counted)."""
    return sum(len(o) for o in gc.get_objects() if issubclass(type(o), _CONTAINERS))


def sharding_cache_entries() -> int:
    """Entries of DTensor's sharding-propagation cache (this thread's; torch 2.13 keeps one per
    thread, with no size bound); -1 where torch has no such cache."""
    try:
        from torch.distributed.tensor import DTensor

        cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        return int(cache.cache_info().currsize)
    except (ImportError, AttributeError):
        return -1


@dataclasses.dataclass
class Sample:
    """The host memory of this process after training step `step`. MiB unless named otherwise;
    `traced_mib` is nan while tracemalloc is off, `tracing_mib` what tracemalloc itself holds
    to store its traces (part of the heap in use and of VmRSS)."""

    step: int
    rss_mib: float
    anon_mib: float
    file_mib: float
    data_mib: float
    heap_used_mib: float
    heap_free_mib: float
    objects: int
    blocks: int
    items: int
    traced_mib: float
    tracing_mib: float
    sharding_cache: int
    types: collections.Counter[str] = dataclasses.field(repr=False)


def sample(step: int, collect: str = "never") -> Sample:
    """Sample this process after step `step` (~0.1 s per 300,000 tracked objects).

    `collect`: "never"; "before": a full collection first, so that the sample counts live
    objects only (a baseline); "after": the count of tracked objects (live, and garbage the
    loop's partial collections left) precedes a full collection. After a full collection the
    blocks, heap and traced bytes are those of live objects, without the garbage and the free
    lists (of floats, and up to 2,000 tuples of each length below 20, that fill over thousands
    of steps) that only a full collection empties."""
    assert collect in ("never", "before", "after"), collect
    if collect == "before":
        gc.collect()
    types = objects_by_type() if collect == "after" else None
    if collect == "after":
        gc.collect()
    used, free = heap_mib()
    traced = tracemalloc.get_traced_memory()[0] / MIB if tracemalloc.is_tracing() else float("nan")
    tracing = tracemalloc.get_tracemalloc_memory() / MIB
    rss, data, cache = status_mib(), mapped_data_mib(), sharding_cache_entries()
    items = container_items() - (len(types) if types is not None else 0)  # less this count
    if types is None:
        types = objects_by_type()  # last: what the calls above create once is there to count
    return Sample(step, rss["VmRSS"], rss["RssAnon"], rss["RssFile"], data, used, free,
                  sum(types.values()), sys.getallocatedblocks(), items, traced, tracing,
                  cache, types)  # fmt: skip


_SAMPLE_TYPES = (type_name(Sample), type_name(collections.Counter))
"""The tracked objects each sample keeps: itself and its count by type."""


def sampling_step(
    real: Callable[..., None],
    at: Collection[int],
    samples: list[Sample],
    trace_from: int = 0,
    full_collect: bool = False,
) -> Callable[..., None]:
    """A stand-in for `TrainLoop._loop_step` that runs `real` and then, after each step in `at`,
    appends a `Sample` to `samples`, less the earlier samples' own objects and items. With `full_collect`
    the first sample is of live objects and each later one counts the garbage left since as
    well (`sample`'s "before" and "after"). From step `trace_from` on (0: never) tracemalloc
    traces every allocation (one frame)."""

    def loop_step(self, *args: Any) -> None:
        real(self, *args)
        if trace_from and self.step == trace_from and not tracemalloc.is_tracing():
            tracemalloc.start(1)
        if self.step in at:
            collect = ("after" if samples else "before") if full_collect else "never"
            s = sample(self.step, collect)
            s.types.subtract({name: len(samples) for name in _SAMPLE_TYPES})
            s.types = +s.types  # keeps positive counts
            s.objects = sum(s.types.values())
            s.items -= len(samples) + sum(len(p.types) for p in samples)
            samples.append(s)

    return loop_step


def run_sampled(
    out: str, at: Collection[int], args: list[str], trace_from: int = 0, full_collect: bool = False
) -> int:
    """`titanlab.train.main(args)` with rank 0 sampling itself after each step in `at`
    (`sampling_step`, with `trace_from` and `full_collect`); returns main's exit code. After
    the last of `at` rank 0 calls `malloc_trim(0)`; at the end it writes `out` (JSON): the
    samples without their types, `top` (`growth_by_type` from the first sample to the last),
    `trimmed_mib` (the VmRSS that malloc_trim handed back) and `step_s` (wall seconds per step
    between the first and the last sample, the samples included). Other ranks train
    unobserved."""
    from titanlab import train

    if os.environ.get("RANK", "0") != "0":
        return train.main(args)
    samples: list[Sample] = []
    real = train.Trainer._loop_step
    sampled = sampling_step(real, at, samples, trace_from, full_collect)
    clock: dict[int, float] = {}
    trimmed: list[float] = []

    def loop_step(self, *a: Any) -> None:
        sampled(self, *a)
        if self.step in at:
            clock[self.step] = time.perf_counter()
        if self.step == max(at):
            before = status_mib()["VmRSS"]
            malloc_trim()
            trimmed.append(before - status_mib()["VmRSS"])

    train.Trainer._loop_step = loop_step  # type: ignore[method-assign,assignment]
    try:
        code = train.main(args)
    finally:
        train.Trainer._loop_step = real  # type: ignore[method-assign]
        tracemalloc.stop()
    record: dict[str, Any] = {
        "samples": [{k: v for k, v in vars(s).items() if k != "types"} for s in samples],
        "top": growth_by_type(samples[0], samples[-1]) if samples else [],
        "trimmed_mib": trimmed[0] if trimmed else float("nan"),
        "step_s": float("nan"),
    }
    if len(samples) > 1:
        first, last = samples[0].step, samples[-1].step
        record["step_s"] = (clock[last] - clock[first]) / (last - first)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f)
    return code


def read_samples(path: str) -> tuple[list[Sample], dict[str, Any]]:
    """The samples `run_sampled` wrote to `path` (with empty type counts), and the record."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    samples = [Sample(**s, types=collections.Counter()) for s in record["samples"]]
    return samples, record


def per_thousand(samples: list[Sample], value: str | Callable[[Sample], float]) -> float:
    """Growth per 1,000 steps of `value` (a field of `Sample`, or a function of one): the
    least-squares slope over `samples` (nan for fewer than two)."""
    get = (lambda s: getattr(s, value)) if isinstance(value, str) else value
    points = [(s.step, get(s)) for s in samples]
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx


def growth_by_type(first: Sample, last: Sample, top: int = 5) -> list[tuple[str, int]]:
    """The `top` types whose tracked-object count grew most from `first` to `last`."""
    grown = (last.types - first.types).most_common(top)
    return [(name, n) for name, n in grown if n > 0]


def _warm_up() -> None:
    """Create what a first sample creates once (the ABCs' cache entries for a Counter made of
    a dict and its subtraction, ctypes' function pointers, a codec), so that samples differ
    only by what ran between them."""
    counts = collections.Counter({type_name(type(None)): 1})
    counts.subtract({type_name(type(None)): 1})
    counts = +counts
    heap_mib()
    status_mib()
    mapped_data_mib()
    sharding_cache_entries()


_warm_up()
