"""LoRA: low-rank adapters on chosen Linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models").

`apply_lora` swaps each targeted `nn.Linear` of a (meta-device) model for a `LoRALinear`: the
same Linear (its `weight` keeps its name, so base checkpoints load unchanged) plus `lora_a`
(r × in) and `lora_b` (out × r), and freezes every parameter that is not an adapter. The output
is W x + (alpha / r) · B A dropout(x). A starts Kaiming-uniform (a = sqrt(5), as torch's Linear
and PEFT initialize it) and B at zero, so a fresh adapter leaves the model's output unchanged.
The model file stays plain: this runs from outside, before parallelism is applied, so FSDP,
activation checkpointing and compile see ordinary modules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.config.errors import ConfigError
from titanlab.config.peft import Peft
from titanlab.peft.dropout import PositionDropout
from titanlab.peft.nf4_split import is_quantized, nf4_linear

ADAPTER_MARK = ".lora_"


class LoRALinear(nn.Linear):
    """A Linear with a LoRA adapter (see the module docstring); the base bias, if any (gpt-oss's
    attention), stays frozen like the weight (PEFT's `bias="none"`).

    Args:
        in_features / out_features: the base Linear's shape; rank, alpha, dropout: the adapter;
        bias: the base Linear has a bias.
    Shapes: input (..., in) → output (..., out), in the input's dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float,
        bias: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)
        self.scaling = alpha / rank
        # Layout-independent: the same mask on every tensor-parallel rank and on 1 process.
        self.dropout = PositionDropout(dropout) if dropout > 0 else nn.Identity()

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A: Kaiming-uniform (bound 1/sqrt(in), from a = sqrt(5)); B: zeros. With `generator`,
        A is drawn on the CPU from it (the same values whatever the layout)."""
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.empty(self.lora_a.weight.shape).uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            _copy_full(self.lora_a.weight, a)
            _copy_full(self.lora_b.weight, torch.zeros(self.lora_b.weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if is_quantized(w):
            base = nf4_linear(x, w)
            base = base if self.bias is None else base + self.bias
        else:
            base = F.linear(x, w, self.bias)
        return base + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within, every LoRALinear of `model` computes its base Linear only (its scaling is 0, so
    W x + 0 · B A x is exactly W x); after, the scalings are restored. The base model's output
    from the adapted module itself, with no second copy of the weights (PEFT's
    `disable_adapter`)."""
    layers = adapted_modules(model)
    saved = [m.scaling for m in layers]
    for m in layers:
        setattr(m, "scaling", 0.0)  # noqa: B010 (a float attribute, not a submodule)
    try:
        yield
    finally:
        for m, scaling in zip(layers, saved):
            setattr(m, "scaling", scaling)  # noqa: B010


def adapted_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that carries a LoRA adapter (`lora_a`, `lora_b`, `scaling`): the
    `LoRALinear`s, and a fused loss head that took over an adapted output head
    (`titanlab.components.fused_head.use_fused_loss`)."""
    return [m for m in model.modules() if isinstance(getattr(m, "lora_b", None), nn.Linear)]


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor `full` into `param`, a plain tensor or a DTensor (its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def lora_targets(model: nn.Module, cfg: Peft, model_name: str = "") -> dict[str, nn.Linear]:
    """The Linears of `model` (a meta-device model is enough) that `cfg.target_modules` adapt,
    by module name. Pre-flight calls this before launch; `apply_lora` adapts what it returns.
    `model_name` (`model.name`) is named in the errors.

    Raises:
        ConfigError: one line when a target name matches no Linear of the model
            (naming the Linear layers it has), names the MoE router (`gate`: its weight is kept
            fp32 and replicated, outside the LoRA path, and exporters keep routers whole), or
            names the output head of a model that ties it to the embedding (the merged head
            could no longer be tied).
    """
    linears = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    targets = set(cfg.target_modules)
    hits = {name: m for name, m in linears.items() if name.rsplit(".", 1)[-1] in targets}
    matched = {name.rsplit(".", 1)[-1] for name in hits}
    missing = sorted(targets - matched)
    if missing:
        have = sorted({name.rsplit(".", 1)[-1] for name in linears})
        which = f"model.name={model_name}" if model_name else "the model"
        raise ConfigError(
            f"peft.target_modules {missing} match no Linear layer of {which}; its Linear "
            f"layers are named {', '.join(have)}"
        )
    routers = sorted({n.rsplit(".", 1)[-1] for n in hits if ".router." in f".{n}"})
    if routers:
        raise ConfigError(
            f"peft.target_modules {routers}: the router of an MoE model is not a LoRA target "
            "(it computes in fp32 outside the adapted layers); adapt attention (wq, wk, wv, "
            "wo) or output"
        )
    output = getattr(model, "output", None)
    embedding = getattr(model, "tok_embeddings", None)
    if (
        "output" in hits
        and embedding is not None
        and output is not None
        and output.weight is embedding.weight
    ):
        raise ConfigError(
            "peft.target_modules ['output']: this model ties the output head to the embedding, "
            "so an adapted head could not be merged or exported tied; adapt the other layers"
        )
    return hits


def apply_lora(model: nn.Module, cfg: Peft, model_name: str = "") -> int:
    """Swap the target Linears of `model` for `LoRALinear`s and freeze all but the adapters.

    Returns:
        the number of Linears adapted.
    Raises:
        ConfigError: as `lora_targets`.
    """
    hits = lora_targets(model, cfg, model_name)
    for name, old in hits.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device(old.weight.device):
            new = LoRALinear(
                old.in_features,
                old.out_features,
                cfg.rank,
                cfg.alpha,
                cfg.dropout,
                bias=old.bias is not None,
            )
        new.weight = old.weight
        if old.bias is not None:
            new.bias = old.bias
        setattr(parent, child, new)
    freeze_base([model])
    return len(hits)


def freeze_base(model_parts: list[nn.Module]) -> None:
    """Make the adapters the only trainable parameters of the model parts."""
    for part in model_parts:
        for name, param in part.named_parameters():
            param.requires_grad_(ADAPTER_MARK in name)


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every frozen floating-point parameter of the (meta-device) `model` in `dtype`,
    the compute dtype: the base is never updated, so an fp32 master copy would only double its
    memory (the adapters, which train, stay fp32). A no-op when `dtype` is fp32. MoE routers
    keep fp32: they compute in fp32 under any mixed precision (`Router.forward`)."""
    from titanlab.models.common.moe import Router

    routers = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
    for p in model.parameters():
        if id(p) in routers:
            continue
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def is_adapter(name: str) -> bool:
    """Whether state-dict / parameter name `name` belongs to a LoRA adapter."""
    return ADAPTER_MARK in name


def init_adapters(model_parts: list[nn.Module], seed: int) -> None:
    """Initialize every adapter of the model parts deterministically from `seed` and the
    module's name (identical values in any parallel layout)."""
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(getattr(module, "lora_b", None), nn.Linear):  # adapted_modules
                plain = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                digest = sum(ord(c) * (i + 1) for i, c in enumerate(plain))
                module.reset_adapter(torch.Generator().manual_seed(seed * 1_000_003 + digest))
