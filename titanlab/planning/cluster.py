"""The machines a layout is planned for: a cluster profile (devices, their memory and peak speed,
the links between them, and the efficiencies the performance model applies).

Built-in profiles (`PROFILES`) describe nodes of 8 NVIDIA GPUs joined by NVLink inside the node
and one InfiniBand NIC per GPU between nodes, from the vendors' data sheets:
- H100 SXM5 80 GB (79.6 GiB): 989 TFLOP/s dense bf16 (1979 float8, 67 fp32 on CUDA cores), HBM3
  3.35 TB/s, NVLink 4 900 GB/s per GPU (450 each way), ConnectX-7 400 Gb/s (50 GB/s each way);
- H200 SXM 141 GB (140.4 GiB): the H100's compute and links, HBM3e 4.8 TB/s;
- A100 SXM4 80 GB (80 GiB): 312 TFLOP/s bf16 (no float8, 19.5 fp32), HBM2e 2.04 TB/s, NVLink 3
  600 GB/s (300 each way), HDR 200 Gb/s (25 GB/s);
- B200 180 GB (179.1 GiB): 2.25 PFLOP/s dense bf16 (4.5 float8; 75 TFLOP/s fp32, the HGX B200
  data sheet's 600 for 8 GPUs), HBM3e 8 TB/s, NVLink 5 1.8 TB/s (900 each way), ConnectX-7
  400 Gb/s.
fp32 is the CUDA cores' rate, not TF32's: titanlab does not enable TF32.
Their efficiencies start from titanlab's own H100 run (docs/performance.md, "GPU (H100 80GB
HBM3)"): block GEMMs at ~760 of 989 TFLOP/s (0.77), attention at 0.85 of the FLOPs it is
counted for, AdamW at ~1.8 of 3.35 TB/s (0.55), pointwise kernels 0.19 of the GEMM time; NCCL's
ring reaching 0.8 of the link. `titanlab.plan --calibrate` replaces them with measured ones.

A profile is also a JSON file (`save_profile` / `load_profile`) with the fields of `Cluster`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field

from titanlab.config.job_config import ConfigError
from titanlab.metrics.flops import peak_bf16_flops

GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a peak the kernels reach (each in (0, 1]), and the pointwise share."""

    matmul: float = 0.77
    """Achieved ÷ peak FLOP/s of the Linear layers' GEMMs."""
    attention: float = 0.85
    """Achieved ÷ peak FLOP/s of attention, counted as 12·L·H·Q·s FLOPs per token (no causal
    discount, the convention of `flops_per_token`)."""
    optimizer: float = 0.55
    """Achieved ÷ peak memory bandwidth of the optimizer step (AdamW reads and writes 28 bytes
    per fp32 parameter: weight, gradient and two moments read, three written)."""
    pointwise: float = 0.19
    """Norms, activations, casts and the loss, as a fraction of the GEMM time."""
    link: float = 0.8
    """Achieved ÷ nominal bandwidth of a collective on a link."""


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: `nodes` × `devices_per_node` devices.

    Units: bytes, bytes per second (one direction, per device), FLOP/s (dense), seconds.
    """

    name: str
    devices_per_node: int
    memory_bytes: float
    peak_flops: dict[str, float]
    """Dense FLOP/s per compute dtype name ("bfloat16", "float8", "float32")."""
    memory_bandwidth: float
    intra_bandwidth: float
    """Per device, one direction, inside a node (NVLink; on CPU the loopback)."""
    inter_bandwidth: float
    """Per device, one direction, between nodes (the device's share of the NICs)."""
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    nodes: int = 1
    efficiency: Efficiency = field(default_factory=Efficiency)
    shared_cores: int = 0
    """On CPU: the cores every rank of a node shares (0: each device is its own); compute is
    slowed by ranks ÷ cores when there are more ranks than cores."""
    device_type: str = "cuda"
    """What the trainer runs on: "cuda", or "cpu" (float32 compute unless
    `training.mixed_precision_on_cpu`)."""
    compute_capability: tuple[int, int] = (0, 0)
    """A CUDA GPU's compute capability (the kernels it has: grouped GEMM from 9.0); (0, 0)
    unknown."""
    split_backward_s: float = 0.0
    """Seconds a block's backward takes, per microbatch, beyond a whole backward when a
    zero-bubble schedule splits it into an input half and a weight half (torch's
    `stage_backward_input` and `stage_backward_weight`: one autograd call per parameter group),
    measured by calibration; 0 in the built-in GPU profiles (not measured there)."""
    tp_block_s: float = 0.0
    """Seconds a block's forward and backward under tensor parallel takes, per microbatch,
    beyond its share of the FLOPs and its collectives' α–β time (DTensor's dispatch, smaller
    GEMMs, on shared CPU cores the hand-offs at each collective), measured by calibration with
    every rank running; 0 in the built-in GPU profiles (not measured there)."""
    fsdp_gather_s: float = 0.0
    """Seconds one FSDP2 all-gather takes beyond its α–β time (the unit's parameters copied
    into and out of the flat buffer, on shared CPU cores the hand-off at the blocking call),
    measured by calibration with every rank running; 0 in the built-in GPU profiles."""
    fsdp_reduce_s: float = 0.0
    """The same for one FSDP2 reduce-scatter (the gradients copied into the flat buffer, then
    out as sharded DTensor gradients); measured as what ZeRO 2 takes per unit beyond DDP's
    all-reduce, less `fsdp_gather_s`."""

    @property
    def world_size(self) -> int:
        """Devices in all: nodes × devices_per_node."""
        return self.nodes * self.devices_per_node

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype`; ConfigError (one line) when the device has none."""
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"cluster {self.name!r} has no {dtype} peak FLOP/s (it has "
                f"{', '.join(sorted(self.peak_flops))}); choose another dtype or profile"
            )
        return self.peak_flops[dtype]

    def with_nodes(self, nodes: int) -> Cluster:
        """This profile on `nodes` nodes; ConfigError (one line) when nodes < 1."""
        if nodes < 1:
            raise ConfigError(f"--nodes={nodes}: a cluster has at least 1 node")
        return dataclasses.replace(self, nodes=nodes)


def _nvidia(name, memory_mib, hbm, nvlink, nic, fp32, capability, fp8_ratio=2.0) -> Cluster:
    bf16 = peak_bf16_flops(name.upper())
    assert bf16 is not None, name  # every built-in profile is in titanlab.metrics' table
    # fp32 GEMMs at the CUDA cores' fp32 rate: titanlab never enables TF32
    # (torch.backends.cuda.matmul.allow_tf32 stays False), so cuBLAS does not use tensor cores.
    peak = {"bfloat16": bf16, "float16": bf16, "float32": fp32}
    if fp8_ratio:
        peak["float8"] = fp8_ratio * bf16
    return Cluster(name, 8, memory_mib * MIB, peak, hbm, nvlink, nic, compute_capability=capability)


# Memory: the total nvidia-smi reports (MiB), of which the pre-flight's check keeps headroom.
PROFILES: dict[str, Cluster] = {
    "h100": _nvidia("h100", 81559, 3.35e12, 450 * GB, 50 * GB, 67e12, (9, 0)),
    "h200": _nvidia("h200", 143771, 4.8e12, 450 * GB, 50 * GB, 67e12, (9, 0)),
    "a100": _nvidia("a100", 81920, 2.04e12, 300 * GB, 25 * GB, 19.5e12, (8, 0), fp8_ratio=0.0),
    "b200": _nvidia("b200", 183359, 8e12, 900 * GB, 50 * GB, 75e12, (10, 0)),
}


def get_profile(name_or_path: str) -> Cluster:
    """A built-in profile by name, in any case ("H100" is "h100"), or one read from a JSON file;
    ConfigError (one line) for an unknown name, with the closest one, or a malformed file."""
    if name_or_path.lower() in PROFILES:
        return PROFILES[name_or_path.lower()]
    if name_or_path.endswith(".json"):
        return load_profile(name_or_path)
    close = difflib.get_close_matches(name_or_path.lower(), list(PROFILES), n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"cluster profile {name_or_path!r} is not known{hint} (use one of "
        f"{', '.join(PROFILES)} or a profile file: *.json with the fields of "
        "titanlab.planning.cluster.Cluster)"
    )


def save_profile(cluster: Cluster, path: str) -> None:
    """Write `cluster` as JSON (the fields of `Cluster`) for `load_profile` / `--cluster`."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(cluster), f, indent=2)


def load_profile(path: str) -> Cluster:
    """A profile written by `save_profile`; ConfigError naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        raw["efficiency"] = Efficiency(**raw.get("efficiency", {}))
        raw["compute_capability"] = tuple(raw.get("compute_capability", (0, 0)))
        cluster = Cluster(**raw)
    except FileNotFoundError:
        raise ConfigError(f"cluster profile file {path} does not exist") from None
    except (json.JSONDecodeError, TypeError, AttributeError) as e:
        raise ConfigError(f"cluster profile file {path} is malformed: {e}") from None
    bad = [
        f.name
        for f in dataclasses.fields(Cluster)
        if f.name in ("memory_bytes", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth")
        and not getattr(cluster, f.name) > 0
    ]
    if not cluster.peak_flops or not all(v > 0 for v in cluster.peak_flops.values()):
        bad.append("peak_flops")
    if cluster.devices_per_node < 1 or cluster.nodes < 1:
        bad.append("devices_per_node and nodes")
    overheads = ("split_backward_s", "tp_block_s", "fsdp_gather_s", "fsdp_reduce_s")
    bad += [f for f in overheads if not getattr(cluster, f) >= 0]
    eff = dataclasses.asdict(cluster.efficiency)
    bad += [
        f"efficiency.{k}"
        for k, v in eff.items()
        if not (0 < v <= 1 or (k == "pointwise" and v >= 0))
    ]
    if bad:
        raise ConfigError(
            f"cluster profile file {path} is malformed: {', '.join(bad)} must be positive "
            "(efficiencies in (0, 1], split_backward_s, tp_block_s, fsdp_gather_s and "
            "fsdp_reduce_s 0 or more)"
        )
    return cluster


def profile_of_this_machine() -> Cluster | None:
    """The profile the pre-flight predicts with: the file `$TITANLAB_CLUSTER_PROFILE` names
    (written by `python -m titanlab.plan --calibrate`), else the built-in profile whose name the
    CUDA device's contains (an "NVIDIA H100 80GB HBM3" is h100), else None. ConfigError (one
    line) for a malformed file."""
    import os

    path = os.environ.get("TITANLAB_CLUSTER_PROFILE", "")
    if path:
        return load_profile(path)
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    return next((p for key, p in PROFILES.items() if key in name), None)
