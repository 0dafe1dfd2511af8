"""The cache of hybrid models (Qwen3-Next, Qwen3.5-MoE): paged keys and values for the full-attention
layers, and a fixed-size recurrent state per sequence for the linear-attention (gated DeltaNet) ones.

A linear-attention layer keeps, per sequence, a conv state (the last `kernel - 1` inputs of its
short causal convolution, [conv_dim, kernel - 1]) and a delta-rule state ([Hv, Dk, Dv]). Both are
preallocated for `max_seqs` sequences. A sequence holds a state slot from its first step until it
is freed.

Each slot keeps `RING` copies of its states: a step reads the copy of the sequence's current
length and writes the next copy, so the states of the last RING - 1 lengths before the current
one stay valid. That is what the engine needs to take back the steps it issued ahead and does not
want (two at most), or a failed step, exactly. A state between those lengths cannot be recovered:
`restorable` says which length a truncation can reach (the engine then recomputes from there),
and the prefix cache does not reuse these sequences (its pages hold no states).
"""
from __future__ import annotations

import torch

from .paged import CacheFullError, ForwardBatch, KGQACache, Sequence

RING = 3  # the current length's states and the two before it


def linear_layers(config) -> list[int]:
    """The indices of a hybrid config's linear-attention layers (empty for other models)."""
    return [i for i, t in enumerate(getattr(config, "layer_types", None) or []) if t == "linear_attention"]


class HybridCache(KGQACache):
    """KGQACache for the full-attention layers (the linear ones get no K/V buffers) and the
    recurrent states of the linear ones (`conv[layer]`, `ssm[layer]`, float32, indexed by a
    step's `state_read` / `state_write` rows: slot * RING + copy)."""

    reuses_prefixes = False  # (pages hold no recurrent states)

    def __init__(self, config, cache_lens: int, page_size: int = 256, device="cpu", dtype=torch.bfloat16,
                 layer_devices: list | None = None, max_seqs: int = 8):
        super().__init__(config, cache_lens, page_size, device, dtype, layer_devices)
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be positive, got {max_seqs}")
        self.linear = linear_layers(config)
        Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
        Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
        K = config.linear_conv_kernel_dim
        self.conv_dim = 2 * Hk * Dk + Hv * Dv
        self.max_seqs = max_seqs
        devices = [torch.device(d) for d in (layer_devices or [self.device] * config.num_hidden_layers)]
        rows = max_seqs * RING
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for i in self.linear:
            self.layers[i] = []  # (no keys or values)
            self.conv[i] = torch.zeros(rows, self.conv_dim, K - 1, device=devices[i], dtype=torch.float32)
            self.ssm[i] = torch.zeros(rows, Hv, Dk, Dv, device=devices[i], dtype=torch.float32)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}  # seq_id -> its state slot
        self._ring: dict[int, list[int]] = {}  # seq_id -> the length each copy holds (-1: none)
        self._current: dict[int, int] = {}  # seq_id -> the copy holding its current length

    # -- sequences -------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        slot = self._slot.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._ring.pop(seq.seq_id, None)
        self._current.pop(seq.seq_id, None)

    @property
    def free_seqs(self) -> int:
        """Sequences that can still take a state slot."""
        return len(self._free_slots)

    def restorable(self, seq: Sequence, length: int) -> int:
        """The longest length <= `length` that `seq` can be truncated to exactly: one whose states
        a copy still holds, else 0."""
        if length >= seq.length:
            return length
        ring = self._ring.get(seq.seq_id, [])
        return max([n for n in ring if 0 <= n <= length], default=0)

    def truncate(self, seq: Sequence, length: int) -> None:
        """As PagedCache.truncate, to a length `restorable` returns (else ValueError): the copy
        holding it becomes current and later copies are forgotten."""
        if length < seq.length and length > 0 and self.restorable(seq, length) != length:
            raise ValueError(f"a hybrid model's sequence of {seq.length} tokens cannot go back to {length}: its "
                             f"recurrent states are kept for the last {RING} lengths only "
                             f"({sorted(n for n in self._ring.get(seq.seq_id, []) if n >= 0)})")
        super().truncate(seq, length)
        ring = self._ring.get(seq.seq_id)
        if ring is None:
            return
        for c, n in enumerate(ring):
            if n > length:
                ring[c] = -1
            elif n == length:
                self._current[seq.seq_id] = c

    def export_pages(self, seq: Sequence, n_pages: int):
        raise ValueError("a hybrid model's prefix cannot be stored: its pages hold no recurrent states")

    def import_pages(self, seq: Sequence, data) -> None:
        raise ValueError("a hybrid model's prefix cannot be restored: its pages hold no recurrent states")

    # -- one step ---------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], q_lens: list[int]) -> ForwardBatch:
        """PagedCache.prepare, and each sequence's state rows: read from the copy of its length
        (`state_fresh`: none yet, the layers start from zeros), written to the next copy."""
        need = [s for s in seqs if s.seq_id not in self._slot]
        if len(need) > len(self._free_slots):
            raise CacheFullError(f"the recurrent states of {self.max_seqs} sequences are all taken "
                                 f"(--max_batch_size); this step needs {len(need)} more")
        batch = super().prepare(seqs, q_lens)
        reads, writes, fresh = [], [], []
        for s, q, start in zip(seqs, q_lens, batch.starts):
            if s.seq_id not in self._slot:
                self._slot[s.seq_id] = self._free_slots.pop()
                self._ring[s.seq_id] = [-1] * RING
                self._current[s.seq_id] = 0
            slot, ring, cur = self._slot[s.seq_id], self._ring[s.seq_id], self._current[s.seq_id]
            is_fresh = start == 0
            if not is_fresh and ring[cur] != start:
                raise RuntimeError(f"sequence {s.seq_id}: no recurrent state for its {start} tokens")
            nxt = (cur + 1) % RING
            reads.append(slot * RING + cur)
            writes.append(slot * RING + nxt)
            fresh.append(is_fresh)
            ring[nxt] = start + q
            self._current[s.seq_id] = nxt
        batch.state_read, batch.state_write, batch.state_fresh = reads, writes, fresh
        return batch

    def bytes(self) -> int:
        return super().bytes() + sum(t.numel() * t.element_size() for d in (self.conv, self.ssm) for t in d.values())
