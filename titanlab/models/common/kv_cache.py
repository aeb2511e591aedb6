"""Key/value cache for generation: prefill a batch of prompts, then decode one token per step.

Used only by generation (`titanlab.generation`); training never passes a cache, and its code
path is unchanged. Prompts of different lengths are left-padded to a common length: sequence b's
prompt fills slots `[pad[b], prompt_len)` of the first `prompt_len` slots, and its RoPE
positions count from its first real token, so each sequence sees exactly the positions and
attention it would see alone (as Hugging Face's `generate` does with an attention mask).
"""

from __future__ import annotations

import torch


class KVCache:
    """The keys and values of every layer for `bs` sequences of at most `max_seq_len` slots.

    Buffers are allocated on a layer's first update with the shapes of its keys and values, so
    under tensor parallel each rank caches its own heads: k and v are (bs, max_seq_len, kv_heads,
    head_dim). Multi-head latent attention caches its compressed latent as k (bs, max_seq_len, 1,
    kv_lora_rank) and its rotary key as v (bs, max_seq_len, 1, qk_rope_head_dim).

    Args:
        pad: (bs,) int64, the number of left-padding slots of each sequence.
        max_seq_len: slots per sequence (prompt + new tokens); at most the model's RoPE length.
    """

    def __init__(self, pad: torch.Tensor, max_seq_len: int) -> None:
        self.pad = pad.long()
        self.max_seq_len = max_seq_len
        self.length = 0  # slots filled by the forwards so far
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._seq = 0
        self._ring_slot: dict[int, torch.Tensor] = {}  # sliding layers: slot of each entry
        self._recurrent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # linear layers

    def begin(self, seq: int) -> torch.Tensor:
        """Start a forward of `seq` new slots; returns their RoPE positions, (bs, seq) int64.

        Raises:
            ValueError: the cache would hold more than `max_seq_len` slots.
        """
        if self.length + seq > self.max_seq_len:
            raise ValueError(
                f"{self.length + seq} tokens exceed max_seq_len={self.max_seq_len}; "
                "shorten the prompt or lower max_new_tokens"
            )
        device = self.pad.device
        slots = torch.arange(self.length, self.length + seq, device=device)  # (seq,)
        keys = torch.arange(self.length + seq, device=device)  # (kv_len,)
        # Query slot i sees key slot j when j <= i and j is not padding; a padding query sees
        # itself only (a row with nothing visible would turn into NaN).
        causal = keys[None, :] <= slots[:, None]  # (seq, kv_len)
        real = keys[None, None, :] >= self.pad[:, None, None]  # (bs, 1, kv_len)
        itself = keys[None, :] == slots[:, None]
        self._mask = (causal[None] & real) | itself[None]  # (bs, seq, kv_len)
        self._seq = seq
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values of `layer` ((bs, seq, kv_heads, head_dim), after
        RoPE); returns every cached key and value so far and the attention mask,
        (bs, 1, seq, kv_len) bool (True: attend). With `window` (a sliding layer), the keys are
        the ring's W entries then this forward's, and the mask also keeps each query within
        its last W slots."""
        assert self._mask is not None and k.shape[1] == self._seq, "call begin(seq) first"
        if window is not None and window < self.max_seq_len:
            return self._update_ring(layer, k, v, window)
        if layer not in self._k:
            self._k[layer] = k.new_zeros((k.shape[0], self.max_seq_len, *k.shape[2:]))
            self._v[layer] = v.new_zeros((v.shape[0], self.max_seq_len, *v.shape[2:]))
        end = self.length + self._seq
        self._k[layer][:, self.length : end] = k
        self._v[layer][:, self.length : end] = v
        return self._k[layer][:, :end], self._v[layer][:, :end], self._mask[:, None]

    def _update_ring(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if layer not in self._k:
            self._k[layer] = k.new_zeros((k.shape[0], window, *k.shape[2:]))
            self._v[layer] = v.new_zeros((v.shape[0], window, *v.shape[2:]))
            self._ring_slot[layer] = torch.full((window,), -1, device=k.device)
        ring_slot = self._ring_slot[layer]
        slots = torch.arange(self.length, self.length + self._seq, device=k.device)
        keys_k = torch.cat([self._k[layer], k], dim=1)  # (bs, W + seq, kv_heads, head_dim)
        keys_v = torch.cat([self._v[layer], v], dim=1)
        key_slot = torch.cat([ring_slot, slots])  # (W + seq,), -1: an empty entry
        pad = self.pad[:, None, None]
        q_slot = slots[:, None]
        seen = (key_slot <= q_slot) & (q_slot - key_slot < window) & (key_slot >= 0)
        mask = (seen[None] & (key_slot[None, None, :] >= pad)) | (key_slot[None, :] == q_slot)[
            None
        ]  # (bs, seq, W + seq); a padding query sees itself only
        keep = slots[-window:]  # the newest W slots of this forward go into the ring
        entry = keep % window
        self._k[layer][:, entry] = k[:, -keep.numel() :]
        self._v[layer][:, entry] = v[:, -keep.numel() :]
        ring_slot[entry] = keep
        return keys_k, keys_v, mask[:, None]

    def real_tokens(self, seq: int) -> torch.Tensor:
        """(bs, seq) bool: which of this forward's `seq` slots hold a real token (not left
        padding)."""
        slots = torch.arange(self.length, self.length + seq, device=self.pad.device)
        return slots[None, :] >= self.pad[:, None]

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A linear-attention layer's state after the slots so far (its convolution history
        and delta-rule state, `common.linear_attention.RecurrentState`), None before the
        first forward."""
        return self._recurrent.get(layer)

    def keep_recurrent(self, layer: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store a linear-attention layer's state after this forward's slots."""
        self._recurrent[layer] = state

    def kv_bytes(self) -> int:
        """Bytes of every layer's cached keys and values (allocated for `max_seq_len` slots)."""
        return sum(t.numel() * t.element_size() for d in (self._k, self._v) for t in d.values())

    def recurrent_bytes(self) -> int:
        """Bytes of every linear-attention layer's state (its convolution history and delta-rule
        state: constant in the sequence length)."""
        return sum(t.numel() * t.element_size() for s in self._recurrent.values() for t in s)

    def cache_bytes(self) -> int:
        """Bytes the whole cache takes (`kv_bytes` + `recurrent_bytes`)."""
        return self.kv_bytes() + self.recurrent_bytes()

    def end(self) -> None:
        """Finish the forward started by `begin`: its slots are now part of the cache."""
        self.length += self._seq
        self._mask, self._seq = None, 0

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (speculative decoding drops a rejected draft's);
        the next forward overwrites them."""
        assert 0 <= length <= self.length and self._mask is None, "between forwards only"
        if self._recurrent and length < self.length:
            raise ValueError(
                "a linear-attention layer's cache holds only its state after the last token "
                "and cannot take back a draft; speculative decoding needs softmax attention"
            )
        if self._ring_slot and length < self.length:
            raise ValueError(
                "a sliding-window layer's cache keeps only its last window slots and cannot "
                "take back a draft; speculative decoding needs a model without sliding windows"
            )
        self.length = length

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)


class LayerCache:
    """One layer's view of a `KVCache`, handed to its attention."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(
        self, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v, window)

    def real_tokens(self, seq: int) -> torch.Tensor:
        return self.cache.real_tokens(seq)

    def recurrent(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.cache.recurrent(self.index)

    def keep_recurrent(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.cache.keep_recurrent(self.index, state)
