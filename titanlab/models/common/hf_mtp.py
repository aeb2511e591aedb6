"""Names of the multi-token prediction depths (`common/mtp.py`) in a Hugging Face checkpoint.

DeepSeek's checkpoints store MTP depth k (0-based) as one more decoder layer, number
`num_hidden_layers + k`, and transformers' `MtpModel` reads them from there:

| titanlab | Hugging Face |
|---|---|
| `mtp.{k}.enorm / hnorm / eh_proj.weight` | `model.layers.{L+k}.enorm / hnorm / eh_proj.weight` |
| `mtp.{k}.norm.weight` | `model.layers.{L+k}.shared_head.norm.weight` |
| `mtp.{k}.block.<block name>` | `model.layers.{L+k}.<the block's HF name>` (as for `layers.{L+k}`) |
| (the main `tok_embeddings.weight`) | `model.layers.{L+k}.embed_tokens.weight`, a copy |
| (the main `output.weight`) | `model.layers.{L+k}.shared_head.head.weight`, a copy |

The two copies are written on export (DeepSeek's files and vLLM's MTP loader have them) and
dropped on import, where the main tensors are the ones trained.
"""

from __future__ import annotations

import re

_OURS = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_OWN_FROM_HF = {v: k for k, v in _OWN.items()}
_COPIES = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "output.weight": "shared_head.head.weight",
}
_COPIES_FROM_HF = set(_COPIES.values())


class MTPNames:
    """The name map of `depths` MTP depths after `n_layers` decoder layers."""

    def __init__(self, n_layers: int, depths: int) -> None:
        self.n_layers, self.depths = n_layers, depths

    def block_as_layer(self, name: str) -> str | None:
        """`mtp.{k}.block.X` → `layers.{L+k}.X` (the HF naming of a decoder layer applies to
        it); None for any other name."""
        m = _OURS.match(name)
        if m is None or not m.group(2).startswith("block."):
            return None
        return f"layers.{self.n_layers + int(m.group(1))}.{m.group(2)[len('block.') :]}"

    def own_hf_name(self, name: str) -> str | None:
        """The HF name of an MTP depth's own weight (norms, `eh_proj`); None otherwise."""
        m = _OURS.match(name)
        if m is None or m.group(2) not in _OWN:
            return None
        return f"model.layers.{self.n_layers + int(m.group(1))}.{_OWN[m.group(2)]}"

    def copies(self, name: str) -> list[str]:
        """The HF names of the per-depth copies of main weight `name` (embedding, head)."""
        if name not in _COPIES:
            return []
        return [f"model.layers.{self.n_layers + k}.{_COPIES[name]}" for k in range(self.depths)]

    def depth_of_hf(self, hf_name: str) -> tuple[int, str] | None:
        """(depth k, the rest of the name) of an HF name inside an MTP depth's layer, else None."""
        m = _HF.match(hf_name)
        if m is None or not self.n_layers <= int(m.group(1)) < self.n_layers + self.depths:
            return None
        return int(m.group(1)) - self.n_layers, m.group(2)

    def own_from_hf(self, k: int, rest: str) -> str | None:
        """`mtp.{k}.<own weight>` for the HF rest of a name, else None."""
        return f"mtp.{k}.{_OWN_FROM_HF[rest]}" if rest in _OWN_FROM_HF else None

    @staticmethod
    def is_copy(rest: str) -> bool:
        """Whether the HF rest of a name is one of the depth's copies of the main weights."""
        return rest in _COPIES_FROM_HF

    def block_from_layer(self, name: str) -> str:
        """`layers.{L+k}.X` → `mtp.{k}.block.X` (inverse of `block_as_layer`)."""
        m = re.match(r"^layers\.(\d+)\.(.+)$", name)
        assert m is not None, name
        return f"mtp.{int(m.group(1)) - self.n_layers}.block.{m.group(2)}"
