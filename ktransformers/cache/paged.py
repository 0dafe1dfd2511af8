"""Paged KV caches: fixed pages of `page_size` token slots, preallocated once, handed to sequences
as they grow (no per-step allocation, no copy when a sequence grows).

One cache serves every layer of a model. Each layer stores one or more *entries* per token: the
DeepSeek-V3 cache keeps the compressed latent (`kv_lora_rank + qk_rope_head_dim` values per
token, one entry), the GQA cache keeps keys and values (two entries of `[kv_heads, head_dim]`).

The engine (or server) describes each forward as a `ForwardBatch`: which sequences take part and
how many new tokens each brings. `PagedCache.prepare` reserves the pages those tokens need and
computes, once per step, the flat slot of every new token and the slots every sequence reads;
attention operators then `write` their new entries and `read` a sequence's whole history.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class CacheFullError(RuntimeError):
    """The cache has no room for the tokens a step needs (raised before anything is written)."""


@dataclass
class Sequence:
    """One sequence's view of the cache: its pages in order and how many tokens it holds."""

    seq_id: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    # the flat slots of its pages, in order (slots[:length] is its history), kept on the cache's
    # device as pages come and go, so a step does not recompute them
    slots: torch.Tensor | None = field(default=None, repr=False)


def pad_slots(read_slots: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int32 [B, max_len] padded with 0, lens int32 [B]) from per-sequence slot lists."""
    lens = [len(s) for s in read_slots]
    table = torch.zeros(len(lens), max(max(lens), 1), dtype=torch.int32, device=device)
    for i, s in enumerate(read_slots):
        table[i, :lens[i]] = s.to(device)
    return table, torch.tensor(lens, dtype=torch.int32, device=device)


@dataclass
class ForwardBatch:
    """What one forward computes: `q_lens[i]` new tokens of `seqs[i]`, packed in that order.

    `starts[i]` is how many tokens seqs[i] held before the step (the position of its first new
    token); `positions` [N] and `slots` [N] give each packed token's position and cache slot;
    `read_slots[i]` lists the slots of seqs[i]'s whole history after the step, in order. Those
    three are made on first use when not given (a CUDA-graph step reads none of them: its
    inputs come from `seqs` and `starts` on the host)."""

    seqs: list[Sequence]
    q_lens: list[int]
    starts: list[int]
    _positions: torch.Tensor | None = None
    _slots: torch.Tensor | None = None
    _read_slots: list[torch.Tensor] | None = None
    _tables: dict = field(default_factory=dict, repr=False)
    # hybrid models (cache.recurrent.HybridCache): each sequence's recurrent-state rows, read and
    # written by the linear-attention layers, and whether it starts from zero states
    state_read: list[int] | None = None
    state_write: list[int] | None = None
    state_fresh: list[bool] | None = None

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            parts = [torch.arange(start, start + q) for q, start in zip(self.q_lens, self.starts)]
            self._positions = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._positions

    @property
    def slots(self) -> torch.Tensor:
        if self._slots is None:
            parts = [s.slots[start:start + q] for s, q, start in zip(self.seqs, self.q_lens, self.starts)]
            self._slots = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._slots

    @property
    def read_slots(self) -> list[torch.Tensor]:
        if self._read_slots is None:
            self._read_slots = [s.slots[:start + q] for s, q, start in zip(self.seqs, self.q_lens, self.starts)]
        return self._read_slots

    def slot_table(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int32 [B, max_len] padded with 0, lens int32 [B]) of every sequence's history,
        on the cache's device (or `device`: a layer on another GPU); built once per step and device
        (the GPU attention kernels read it)."""
        if "table" not in self._tables:
            self._tables["table"] = pad_slots(self.read_slots, self.read_slots[0].device)
        table, lens = self._tables["table"]
        if device is None or torch.device(device) == table.device:
            return table, lens
        key = ("table", str(device))
        if key not in self._tables:
            self._tables[key] = (table.to(device), lens.to(device))
        return self._tables[key]

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """The new tokens' slots on `device` (copied once per step for a layer on another device)."""
        if self.slots.device == device:
            return self.slots
        key = ("slots", str(device))
        if key not in self._tables:
            self._tables[key] = self.slots.to(device)
        return self._tables[key]

    def state_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_read, state_write) as int64 tensors on `device`, made once per step and device
        (a CUDA-graph step's are static buffers the graph reads)."""
        key = ("states", str(device))
        if key not in self._tables:
            self._tables[key] = (torch.tensor(self.state_read, dtype=torch.long, device=device),
                                 torch.tensor(self.state_write, dtype=torch.long, device=device))
        return self._tables[key]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def spans(self):
        """(index, first packed token, q_len, start) for every sequence."""
        offset = 0
        for i, (q, s) in enumerate(zip(self.q_lens, self.starts)):
            yield i, offset, q, s
            offset += q


class PagedCache:
    """Pages shared by all sequences; per layer one buffer per entry of shape
    `[num_pages * page_size, *entry_shape]` (a flat slot index addresses one token)."""

    # a sequence's pages alone hold all it needs to resume (the prefix cache may keep and reuse them)
    reuses_prefixes = True

    def __init__(self, num_layers: int, entry_shapes: list[tuple[int, ...]], cache_lens: int, page_size: int = 256,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 layer_devices: list | None = None):
        """`layer_devices`: where each layer's buffers live when layers are spread over several GPUs
        (default: all on `device`, which also holds the step's slot bookkeeping)."""
        if cache_lens < 1 or page_size < 1:
            raise ValueError(f"cache_lens ({cache_lens}) and page_size ({page_size}) must be positive")
        self.page_size = page_size
        self.num_pages = math.ceil(cache_lens / page_size)
        self.capacity = self.num_pages * page_size
        self.device, self.dtype = torch.device(device), dtype
        slots = self.num_pages * page_size
        devices = [torch.device(d) for d in (layer_devices or [self.device] * num_layers)]
        if len(devices) != num_layers:
            raise ValueError(f"layer_devices names {len(devices)} devices for {num_layers} layers")
        self.layers = [[torch.zeros(slots, *shape, device=d, dtype=dtype) for shape in entry_shapes] for d in devices]
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._next_id = 0

    # -- sequences -------------------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        self._next_id += 1
        return Sequence(self._next_id)

    def free(self, seq: Sequence) -> None:
        """Return a sequence's pages (it may be reused, empty, afterwards)."""
        self._free.extend(reversed(seq.pages))
        seq.pages, seq.length, seq.slots = [], 0, None

    def truncate(self, seq: Sequence, length: int) -> None:
        """Forget the tokens of `seq` from `length` on (keeping a shared prefix), freeing whole pages."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} tokens to {length}")
        keep = math.ceil(length / self.page_size)
        self._free.extend(reversed(seq.pages[keep:]))
        del seq.pages[keep:]
        seq.length = length
        if seq.slots is not None:
            seq.slots = seq.slots[:keep * self.page_size]

    def restorable(self, seq: Sequence, length: int) -> int:
        """The longest length <= `length` that `seq` can be truncated to: any, here (a hybrid
        model's cache keeps states for a few lengths only)."""
        return length

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """How many more pages `seq` needs to hold `n` more tokens."""
        return max(0, math.ceil((seq.length + n) / self.page_size) - len(seq.pages))

    def can_grow(self, seq: Sequence, n: int) -> bool:
        return self.pages_needed(seq, n) <= len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    # -- one step ---------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], q_lens: list[int]) -> ForwardBatch:
        """Reserve room for `q_lens[i]` more tokens of each sequence and describe the step.
        Raises CacheFullError (changing nothing) when the pages do not suffice."""
        if len(seqs) != len(q_lens) or any(q < 1 for q in q_lens):
            raise ValueError(f"need one positive token count per sequence, got {q_lens} for {len(seqs)} sequences")
        need = [self.pages_needed(s, q) for s, q in zip(seqs, q_lens)]
        if sum(need) > len(self._free):
            longest = max(s.length + q for s, q in zip(seqs, q_lens))
            raise CacheFullError(
                f"the KV cache is full: this step needs {sum(need)} more pages of {self.page_size} tokens, "
                f"{len(self._free)} are free (capacity {self.capacity} tokens, the longest sequence would hold "
                f"{longest}); raise --cache_lens or shorten the prompt / --max_new_tokens")
        for s, n in zip(seqs, need):
            if n:
                self._add_pages(s, [self._free.pop() for _ in range(n)])
        starts = [s.length for s in seqs]
        for s, q in zip(seqs, q_lens):
            s.length += q
        return ForwardBatch(list(seqs), list(q_lens), starts)  # (its tensors made when first read)

    def _add_pages(self, seq: Sequence, pages: list[int]) -> None:
        seq.pages.extend(pages)
        new = self._page_slots(pages)
        seq.slots = new if seq.slots is None or seq.slots.numel() == 0 else torch.cat([seq.slots, new])

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat slot of seq's token at `position`, on the host (seq.slots holds the same,
        on the cache's device)."""
        return seq.pages[position // self.page_size] * self.page_size + position % self.page_size

    def _page_slots(self, pages: list[int]) -> torch.Tensor:
        """Every slot of these pages, in order: slot(seq, i) for i over them."""
        table = torch.tensor(pages, dtype=torch.long)
        return (table[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1).to(self.device)

    def export_pages(self, seq: Sequence, n_pages: int) -> list[list[torch.Tensor]]:
        """Copies (on the CPU) of every layer's entries in the first `n_pages` pages of `seq`."""
        if not 0 < n_pages <= len(seq.pages):
            raise ValueError(f"cannot export {n_pages} pages of a sequence holding {len(seq.pages)}")
        slots = self._page_slots(seq.pages[:n_pages])
        return [[buffer.index_select(0, slots.to(buffer.device)).cpu() for buffer in layer] for layer in self.layers]

    def import_pages(self, seq: Sequence, data: list[list[torch.Tensor]]) -> None:
        """Fill an empty `seq` with exported pages (as many tokens as they hold). Raises
        CacheFullError (changing nothing) when there are not enough free pages."""
        if seq.length or seq.pages:
            raise ValueError("import_pages needs an empty sequence")
        tokens = int(data[0][0].shape[0])
        n_pages = tokens // self.page_size
        if n_pages * self.page_size != tokens or len(data) != len(self.layers):
            raise ValueError(f"exported data of {tokens} tokens and {len(data)} layers does not fit this cache")
        if n_pages > len(self._free):
            raise CacheFullError(f"{n_pages} pages needed, {len(self._free)} free")
        self._add_pages(seq, [self._free.pop() for _ in range(n_pages)])
        slots = seq.slots
        for layer, saved in zip(self.layers, data, strict=True):
            for buffer, values in zip(layer, saved, strict=True):
                buffer.index_copy_(0, slots.to(buffer.device), values.to(buffer.device, buffer.dtype))
        seq.length = tokens

    def write(self, layer: int, batch: ForwardBatch, *entries: torch.Tensor) -> None:
        """Store the step's new entries ([N, *entry_shape] each, packed like the batch)."""
        for buffer, value in zip(self.layers[layer], entries, strict=True):
            buffer.index_copy_(0, batch.slots_on(buffer.device),
                               value.to(buffer.device, buffer.dtype).reshape(-1, *buffer.shape[1:]))

    def read(self, layer: int, batch: ForwardBatch, i: int) -> list[torch.Tensor]:
        """Every entry of sequence i's history (this step's tokens included), [L, *entry_shape]."""
        return [buffer.index_select(0, batch.read_slots[i].to(buffer.device)) for buffer in self.layers[layer]]


class KDeepSeekV3Cache(PagedCache):
    """MLA latent cache: per token the normalised compressed KV (`kv_lora_rank`) followed by the
    rotated shared key (`qk_rope_head_dim`) — 576 values a token for DeepSeek-V3, 1/57 of the
    full keys and values of its 128 heads."""

    def __init__(self, config, cache_lens: int, page_size: int = 256, device="cpu", dtype=torch.bfloat16,
                 layer_devices: list | None = None):
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        super().__init__(config.num_hidden_layers, [(self.kv_lora_rank + self.rope_dim,)], cache_lens, page_size,
                         device, dtype, layer_devices)


class KGQACache(PagedCache):
    """Keys and values of grouped-query attention (Qwen3-MoE, Qwen2-MoE, Mixtral)."""

    def __init__(self, config, cache_lens: int, page_size: int = 256, device="cpu", dtype=torch.bfloat16,
                 layer_devices: list | None = None):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_key_value_heads, head_dim)
        super().__init__(config.num_hidden_layers, [shape, shape], cache_lens, page_size, device, dtype, layer_devices)
