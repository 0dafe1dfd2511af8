"""Layer-wise prefill: long prompts computed on the GPU although the experts live in RAM, the
layer's stored experts streamed to the GPU group by group while the one before computes."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .cpu import KExpertsCPU
from .reference import ExpertSpec, load_biases


class PinnedSlots:
    """A ring of page-locked chunks that layer-wise prefill stages stored experts in on their way
    to the GPU: the CPU pool copies the next chunk from the mapped file into the next slot while
    the copies of the slots before it to the GPU (from pinned memory: at the bus's speed, and
    asynchronous) may still be in flight; a slot is refilled once its last copy is done. Shared by
    a model's MoE layers (link_layerwise_prefill): SLOTS x the chunk of page-locked RAM in all,
    whatever the size of a layer."""

    SLOTS = 8

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self.events: list = [None] * self.SLOTS  # the CUDA event of each slot's last copy to the GPU
        self.turn = 0

    @classmethod
    def nbytes(cls, chunk: int) -> int:
        """Page-locked bytes the ring holds at `chunk` bytes a slot (torch's pinned allocator rounds
        each up to a power of two)."""
        return cls.SLOTS * (1 << (max(1, chunk) - 1).bit_length())

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(index, a pinned uint8 buffer of at least nbytes) whose previous copy has finished;
        give the copy that reads it to done()."""
        i, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        if self.buffers[i] is None or self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return i, self.buffers[i]

    def done(self, i: int, event) -> None:
        """Slot i is free again once `event` (recorded after its copy was enqueued) has passed."""
        self.events[i] = event


LAYERWISE_GROUP_MB = 2048  # layer-wise prefill's default group of experts, MiB of bf16 weights


def expert_groups(experts: int, bf16_bytes_per_expert: int, budget: int) -> list[tuple[int, int]]:
    """[e0, e1) ranges of a layer's experts that layer-wise prefill dequantizes and computes at
    once: as many experts as `budget` bytes of bf16 weights hold (at least one)."""
    n = max(1, min(experts, budget // max(1, bf16_bytes_per_expert)))
    return [(e0, min(experts, e0 + n)) for e0 in range(0, experts, n)]


class LayerwisePrefill:
    """Long prompts on the GPU although the experts live in RAM: the layer's expert tensors, as
    stored (GGML blocks, 4-6 bits a weight), are copied to the GPU, dequantized there to bf16 and
    run by the fused-MoE kernel. Worth it when the prompt is long enough that compute, not the
    copy, is the cost (`prefill_gpu_threshold` tokens).

    A layer goes in groups of experts whose bf16 weights fit the rule's prefill_gpu_group_mb (2 GiB
    by default: all of a Qwen3-30B-A3B layer's 128 in one; a DeepSeek-V3 layer's 256, 22 GB in
    bf16, in groups of 24), so the GPU holds one group dequantized and the next arriving, not a
    layer. The bytes go mapped file -> pinned staging (PinnedSlots, chunks copied by the CPU pool)
    -> GPU on a copy stream: pageable memory reaches the GPU far slower, one driver thread staging
    it. Once a group's compute is enqueued the CPU stages the following group's bytes (the layer's
    next, else the next layer's first) chunk by chunk, each chunk's copy to the GPU enqueued as
    soon as it is staged: the bus moves one chunk while the pool fills the next, and both overlap
    the compute already on the GPU (the copy stream does not wait for it; the GPU buffers are marked used by
    the compute stream, so the allocator reuses them only after it).

    Where the CPU experts hold their weights in 16-row tiles of Q4_K/Q6_K (RAM copies the GPU can
    read once page-locked: pcie_experts' registration, else one of its own), nothing is staged: a
    kernel on the copy stream reads the next group's tiles in place over the bus and writes them
    in bf16 (pcie_experts.dequantize_tiles), each byte crossing once, while this group computes."""

    CHUNK = 32 << 20

    def __init__(self, spec: ExpertSpec, device: torch.device, group_mb: int = 0):
        self.spec, self.key, self.device = spec, spec.key, device
        self.group_bytes = (group_mb or LAYERWISE_GROUP_MB) << 20  # bf16 weights of the experts dequantized at once
        self.parts: list[tuple[torch.Tensor, int, tuple[int, int, int]]] = []  # (bytes, ggml type, shape)
        self.groups: list[tuple[int, int]] = []
        self.next: LayerwisePrefill | None = None  # the following MoE layer, prefetched while this one runs
        self._pending = None  # (group, event, GPU tensors) of a copy in flight
        self._stream = None
        self._context = None
        self.slots: PinnedSlots | None = None  # shared with the other layers (link_layerwise_prefill)
        self.tiles = None  # ((gate, up, down) tile buffers the GPU reads in place, their ggml types)
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [E, 2I], down [E, H]) float32, on the GPU
        self._registration = None  # a HostRegistration of those tiles made here (None: pcie_experts' own)

    @staticmethod
    def gpu_bytes(experts: int, bf16_bytes_per_expert: int, stored_bytes: int, group_mb: int = 0) -> int:
        """The GPU memory a layer's prefill holds at once: one group in bf16 computing, and the
        next arriving: two groups' stored bytes (staged) or the next in bf16 (read from tiles)."""
        n = expert_groups(experts, bf16_bytes_per_expert, (group_mb or LAYERWISE_GROUP_MB) << 20)[0][1]
        return n * bf16_bytes_per_expert + max(n * bf16_bytes_per_expert, 2 * -(-stored_bytes * n // experts))

    def load(self, weights, context, cpu_op=None) -> None:
        """`cpu_op`: the layer's CPU experts, whose tiles (where it has them) are read in place."""
        self._context = context
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        for proj, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            stored = weights.raw_stacked(f"{self.key}.{proj}_proj")
            if stored is None or stored[1].shape != shape:
                raise ValueError(f"{self.key}: layer-wise prefill needs the {proj} experts stored as one GGML tensor")
            data = torch.as_tensor(np.asarray(stored[0]).reshape(-1))
            if data.numel() % E:
                raise ValueError(f"{self.key}: the stored {proj} experts ({data.numel()} bytes) do not split into "
                                 f"{E} experts")
            self.parts.append((data, int(stored[1].ggml_type), shape))
        self.groups = expert_groups(E, 3 * I * H * 2, self.group_bytes)
        self.tiles = self._tiles(cpu_op)
        if self.spec.bias:
            self.bias = load_biases(weights, self.spec, self.device, torch.float32)

    def _tiles(self, cpu_op):
        """(tile buffers, types) of the CPU experts where the GPU can read them in place (what
        pcie_experts reads: KExpertsCPU._pcie_unsupported says where not), else None."""
        from ...kernels.triton.pcie_experts import HostRegistration
        if not isinstance(cpu_op, KExpertsCPU) or cpu_op.kernel is None:
            return None
        w = cpu_op.kernel._weights
        if cpu_op._pcie_unsupported(w) is not None:
            return None
        tiles = tuple(p.data for p in w)
        if cpu_op.pcie is None:  # (pcie_experts registers them itself; twice would fail)
            try:
                self._registration = HostRegistration(tiles)
            except RuntimeError as e:  # e.g. the locked-memory limit: stage the GGUF's bytes instead
                warnings.warn(f"{self.key}: layer-wise prefill stages its experts through pinned buffers: {e}",
                              stacklevel=3)
                return None
        return tiles, tuple(p.ggml_type for p in w)

    def unload(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self.tiles = self.bias = None

    def _copy(self, group: int):
        """Send group `group` to the GPU on the copy stream; (group, event, GPU tensors). From
        tiles: the group in bf16 (gate_up, down), read in place. Else its stored bytes, staged
        chunk by chunk (CPU pool, blocking), each chunk's copy to the GPU enqueued once staged."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        if self.tiles is not None:
            return self._read_tiles(group)
        if self.slots is None:
            self.slots = PinnedSlots()
        slots, runtime = self.slots, self._context.cpu_runtime()
        sources = [self._own(data, group) for data, _, _ in self.parts]
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            on_gpu = [torch.empty(src.numel(), dtype=torch.uint8, device=self.device) for src in sources]
            try:
                for src, dst in zip(sources, on_gpu):
                    n = src.numel()
                    for c in range(0, n, self.CHUNK):
                        e = min(n, c + self.CHUNK)
                        slot, buffer = slots.take(self.CHUNK)
                        runtime.copy(buffer[:e - c], src[c:e])
                        dst[c:e].copy_(buffer[:e - c], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self._stream)
                        slots.done(slot, done)  # the slot may be refilled once this copy is done
            finally:  # (after a failed chunk too: what was enqueued is waited for through the event)
                event.record(self._stream)
        return group, event, on_gpu

    def _own(self, data: torch.Tensor, group: int) -> torch.Tensor:
        """Group `group`'s experts of a tensor of all the layer's (its bytes split evenly by expert)."""
        e0, e1 = self.groups[group]
        per = data.numel() // self.spec.experts
        return data[per * e0:per * e1]

    def _to_bf16(self, group: int, parts, decode) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [n, 2I, H], down [n, H, I]) in bf16 from the group's (gate, up, down) `parts`
        as (bytes, ggml type), each written by decode(bytes, type, shape, out=...): dequant.dequantize
        (GGUF blocks) or pcie_experts.dequantize_tiles."""
        e0, e1 = self.groups[group]
        n, H, I = e1 - e0, self.spec.hidden, self.spec.intermediate
        (g, tg), (u, tu), (d, td) = parts
        gate_up = torch.empty(n, 2 * I, H, dtype=torch.bfloat16, device=self.device)  # gate rows, then up rows
        down = torch.empty(n, H, I, dtype=torch.bfloat16, device=self.device)
        decode(g, tg, (n, I, H), out=gate_up[:, :I])
        decode(u, tu, (n, I, H), out=gate_up[:, I:])
        decode(d, td, (n, H, I), out=down)
        return gate_up, down

    def _read_tiles(self, group: int):
        from ...kernels.triton.pcie_experts import dequantize_tiles
        tiles, types = self.tiles
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            weights = self._to_bf16(group, [(self._own(t, group), ty) for t, ty in zip(tiles, types)],
                                    dequantize_tiles)
            event.record(self._stream)
        return group, event, list(weights)

    def _weights(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group `group`'s (gate_up [n, 2I, H], down [n, H, I]) in bf16 on the GPU, for the compute
        stream (its bytes from the copy in flight, else copied now)."""
        from ...kernels.triton.dequant import dequantize  # one launch a tensor (Q4_K, Q6_K, Q8_0)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] != group:  # (a prefetch this call does not use: let it land)
            pending[1].synchronize()
            pending = None
        _, event, on_gpu = pending or self._copy(group)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in on_gpu:  # allocated on the copy stream, read on this one: freed after this one's use
            t.record_stream(stream)
        if self.tiles is not None:  # (already the group in bf16)
            return on_gpu[0], on_gpu[1]
        return self._to_bf16(group, [(b, t) for b, (_, t, _) in zip(on_gpu, self.parts)], dequantize)

    def _prefetch_after(self, group: int) -> None:
        """Stage and send what runs after group `group`: the layer's next group, else the next
        layer's first."""
        if group + 1 < len(self.groups):
            self._pending = self._copy(group + 1)
        elif self.next is not None:
            self.next._pending = self.next._copy(0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from ...kernels.triton.fused_moe import fused_moe, fused_moe_block_m
        x, ids, weights = x.to(self.device), ids.to(self.device), weights.to(self.device)
        (T, K), H = ids.shape, x.shape[1]
        pairs = torch.zeros(T * K, H, dtype=torch.float32, device=self.device)
        block_m = fused_moe_block_m(T, K, self.spec.experts)
        for group, (e0, e1) in enumerate(self.groups):
            gate_up, down = self._weights(group)
            local = torch.where((ids >= e0) & (ids < e1), ids - e0, -1)
            bias = None if self.bias is None else (self.bias[0][e0:e1], self.bias[1][e0:e1])
            fused_moe(x, local, weights, gate_up, down, pairs=pairs, block_m=block_m, bias=bias, act=self.spec.act)
            del gate_up, down  # (freed on the compute stream: the next group's dequantize reuses them)
            self._prefetch_after(group)
        return pairs.view(T, K, H).sum(1)
