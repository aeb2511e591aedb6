"""Parameter counts of the planner's read-only meta models, each module counted once.

The layout planner estimates the memory of hundreds of layouts of one model (`memory._meta_model`
builds it once); each estimate asks for the parameter elements of the model, its blocks, its
pipeline stages' modules and its experts. Counted afresh, that was about a third of the time of
`titanlab plan` for Llama 3 8B on 64 GPUs, outside the activation traces. The counts are kept per
module object (weakly, so a model dropped from the meta-model cache takes its counts with it);
only modules that are never changed after they are built may be passed here.
"""

from __future__ import annotations

import weakref

from torch import nn

_PARAMS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_EXPERTS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_MOE_LAYERS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def params(module: nn.Module) -> int:
    """`count_params(module)` (elements; tied tensors once), remembered per module."""
    if module not in _PARAMS:
        from titanlab.models.common.counting import count_params

        _PARAMS[module] = count_params(module)
    return _PARAMS[module]


def moe_layers(module: nn.Module) -> list:
    """The MoE layers of `module` in layer order (`decoder.moe_layers`), remembered per module."""
    if module not in _MOE_LAYERS:
        from titanlab.models.common.decoder import moe_layers as find

        _MOE_LAYERS[module] = find(module)
    return _MOE_LAYERS[module]


def expert_params(module: nn.Module) -> int:
    """Elements of the routed experts' weights in `module`'s MoE layers, remembered per module."""
    if module not in _EXPERTS:
        _EXPERTS[module] = sum(params(m.experts) for m in moe_layers(module))
    return _EXPERTS[module]


_TP_WHOLE: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()


def tp_whole_params(model: nn.Module, module: nn.Module | None = None) -> int:
    """Elements of `module`'s parameters (default: all of `model`'s) that tensor parallel keeps
    whole on every tp rank: all but the Linears `apply_tp` splits (`linear_split_dims`), the
    embedding, the routed experts (expert parallel's) and attention sinks (split with their
    heads). The norms, MLA's `wkv_a`, the routers and the shared experts; DeepSeek-V3 16B: 0.49B
    of its 16.0B. `model` is a decoder on the meta device, remembered per model."""
    if model not in _TP_WHOLE:
        from titanlab.distributed.tensor_parallel.one_d import linear_split_dims

        split = set(linear_split_dims(model)) | {"tok_embeddings"}  # type: ignore[arg-type]
        _TP_WHOLE[model] = frozenset(
            id(p) for name, p in model.named_parameters()
            if name.rsplit(".", 1)[0] not in split and ".experts." not in name
            and not name.endswith("sinks")
        )  # fmt: skip
    whole = _TP_WHOLE[model]
    return sum(p.numel() for p in (module or model).parameters() if id(p) in whole)
