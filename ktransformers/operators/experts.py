"""Routed experts: KTransformersExperts replaces HF's fused experts module and dispatches by phase.

Shapes: x [T, H]; top_k_index, top_k_weights [T, K]; gate_up [E, 2I, H]; down [E, H, I].
    y[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = top_k_index[t, k]
Ops (EXPERT_OPS) own the expert weights in their format: KExpertsTorch is the dense reference.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseInjectedModule, Placement, choices, device_field
from .registry import EXPERT_OPS, register_operator


def check_routing(key: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_experts: int) -> None:
    """Raise ValueError (naming the operator) unless x [T, H], ids/weights [T, K] and 0 <= ids < E."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{key}: expected x [T, H] and top_k_index/top_k_weights [T, K], got "
                         f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"{key}: top_k_index must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        raise ValueError(f"{key}: expert ids must lie in [0, {n_experts}), got min {int(ids.min())} max {int(ids.max())}")


def moe_reference(x, ids, weights, gate_up, down, round_x=None, round_h=None, round_up=None) -> torch.Tensor:
    """The MoE formula, token-grouped per expert, in x's dtype. round_x / round_h, when given,
    transform the inputs of gate/up and of down (to model a kernel's activation rounding);
    round_up, when up's input is rounded otherwise than gate's (weights of another type)."""
    identity = lambda t: t  # noqa: E731
    round_x, round_h = round_x or identity, round_h or identity
    round_up = round_up or round_x
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    token_of, k = ids.shape[1], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[k:k + n]
        k += n
        tokens = slots // token_of
        gate_w, up_w = gate_up[e].chunk(2, dim=0)
        gate, up = F.linear(round_x(x[tokens]), gate_w), F.linear(round_up(x[tokens]), up_w)
        y = F.linear(round_h(F.silu(gate) * up), down[e])
        out.index_add_(0, tokens, y * weights.reshape(-1)[slots, None].to(y.dtype))
    return out


@dataclass(frozen=True)
class ExpertSpec:
    """What an experts op is built for: E experts of H -> I -> H, K per token, in the model's dtype."""
    key: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    dtype: torch.dtype
    int8_prefill: bool = False  # KExpertsCPU: keep int8 copies for the prefill GEMM (more RAM, faster prefill)
    # KExpertsCPU fed from a GPU: of each decode token's top-k, the GPU computes this many ("auto": by rates)
    pcie_experts: int | str = 0
    int4_group: int = 0  # KExpertsCPU: int4 prefill copies in groups of this many columns instead (0: none)
    int4_decode: bool = False  # KExpertsCPU: the int4 copies serve decode too; the stored weights are not kept


@EXPERT_OPS.register("KExpertsTorch")
class KExpertsTorch:
    """Reference experts: dense [E, 2I, H] and [E, H, I] weights in the model's dtype on one device."""

    def __init__(self, spec: ExpertSpec, device: torch.device):
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None

    def load(self, weights, context) -> None:
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        self.gate_up = weights.load(f"{self.key}.gate_up_proj", self.device, self.dtype, (E, 2 * I, H))
        self.down = weights.load(f"{self.key}.down_proj", self.device, self.dtype, (E, H, I))

    def unload(self) -> None:
        self.gate_up = self.down = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        return moe_reference(x.to(self.dtype), ids, weights, self.gate_up, self.down)


# The GPU's fixed cost of a share, seconds: its two launches and the bus's first bytes (with the
# rates below, fitted to the H200 host's decode runs: 2 of 8 Qwen3 experts faster than none, 3 slower)
PCIE_SHARE_OVERHEAD_S = 25e-6
# The rates the model takes, as fractions of the measured ones (the H200 host, docs/gpu.md): the
# CPU kernel streams ~0.8 of the pool's stream probe (~98 of 128-134 GB/s at T=1), ~0.85 of that
# while the bus reads the same memory (~82), and the bus reads at ~0.65 of its rate alone beside
# the cores (3-expert shares, 9.2 MB, took ~270-305 us beside 5 experts on the CPU, in three runs)
PCIE_SHARE_CPU_KERNEL = 0.8
PCIE_SHARE_CPU_BESIDE = 0.85
PCIE_SHARE_BUS_BESIDE = 0.65
# "auto" measures no rates and takes no share for experts smaller than this (tiny models): their
# top-k on the CPU take about the GPU's fixed cost or less
PCIE_SHARE_MIN_EXPERT_BYTES = 1 << 20


def pcie_share_size(top_k: int, expert_bytes: int, bus_gbps: float, cpu_gbps: float,
                    overhead_s: float = PCIE_SHARE_OVERHEAD_S) -> int:
    """The share n of a token's top_k experts (each expert_bytes of weights) that makes the slower
    of the two sides quickest: the GPU's overhead_s + n experts over the bus, against the CPU's
    top_k - n experts at its kernel's rate, slower while the bus reads the same memory (the
    PCIE_SHARE_* fractions of the measured rates); ties: the smaller n. 0 where the share does
    not pay, e.g. where all top_k experts on the CPU take less than the GPU's fixed cost."""
    cpu = cpu_gbps * PCIE_SHARE_CPU_KERNEL * 1e9
    bus = bus_gbps * PCIE_SHARE_BUS_BESIDE * 1e9

    def step(n: int) -> float:
        reading = n * expert_bytes / bus  # the bus's reads, beside which the cores are slower
        cpu_bytes = (top_k - n) * expert_bytes
        beside = reading * cpu * PCIE_SHARE_CPU_BESIDE  # what the cores read meanwhile
        if cpu_bytes <= beside:
            cpu_s = cpu_bytes / (cpu * PCIE_SHARE_CPU_BESIDE)
        else:
            cpu_s = reading + (cpu_bytes - beside) / cpu
        return max(overhead_s + reading if n else 0.0, cpu_s)
    return min(range(top_k), key=lambda n: (step(n), n))


def auto_pcie_experts(context, top_k: int, expert_bytes: int) -> int:
    """pcie_experts "auto": pcie_share_size at the rates with which the bus and the CPU's threads
    read host memory, measured once per run context (~1 s; on the H200 host 51 and 110-145 GB/s:
    2 of a Qwen3-30B-A3B layer's 8 experts, 3 MB each)."""
    if expert_bytes < PCIE_SHARE_MIN_EXPERT_BYTES:
        return 0
    rates = context.pcie_rates
    if rates is None:
        from ..kernels.triton.pcie_experts import bus_read_gbps
        try:
            rates = bus_read_gbps(torch.device("cuda")), context.cpu_runtime().stream_gbps(1.0, 3)
        except Exception as e:  # (pinned memory refused, no Triton for this GPU, out of memory...)
            warnings.warn(f"pcie_experts auto is off: measuring the bus's and the CPU's read rates failed: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
            rates = (0.0, 1.0)
        context.pcie_rates = rates
    bus, cpu = rates
    return pcie_share_size(top_k, expert_bytes, bus, cpu) if bus > 0 else 0


class PcieShare(NamedTuple):
    """KExpertsCPU's pcie_experts in use: the GPU computes the pairs of top-k columns col0.. from
    the kernel's tiles (their ggml types), page-locked by `registration` while loaded."""
    col0: int
    types: tuple[int, int, int]
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    registration: object  # kernels.triton.pcie_experts.HostRegistration


@EXPERT_OPS.register("KExpertsCPU")
class KExpertsCPU:
    """The C++ CPU experts on the stored GGML blocks: views of the GGUF's stacked expert tensors
    (per-expert files are stacked once), repacked into 16-row tiles where the format has them and
    RAM holds them (context.cpu_tiles); types the kernels do not compute on, and FP8/other
    safetensors, are converted once to bf16."""

    checks_routing = True  # MoEKernel checks shapes and dtypes, the C++ side every expert id

    def __init__(self, spec: ExpertSpec, device: torch.device):
        if device.type != "cpu":
            raise ValueError(f"{spec.key}: KExpertsCPU runs on the CPU, not {device}")
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.kernel = None
        self.pcie: PcieShare | None = None  # pcie_experts' share, once loaded

    def _projection(self, weights, proj: str, shape: tuple[int, ...]):
        from ..kernels.cpu import ACTIVATION_BLOCK, ExpertWeights
        from .linear import dense_weights
        name = f"{self.key}.{proj}_proj"
        stored = weights.raw_stacked(name)
        if stored is not None and int(stored[1].ggml_type) in ACTIVATION_BLOCK and stored[1].shape == shape:
            return ExpertWeights(stored[0], int(stored[1].ggml_type))
        return dense_weights(weights, name, shape, self.dtype)

    def load(self, weights, context) -> None:
        from ..kernels.cpu import MoEKernel
        self.context = context
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        gate, up = self._projection(weights, "gate", (E, I, H)), self._projection(weights, "up", (E, I, H))
        down = self._projection(weights, "down", (E, H, I))
        int8, int4 = self._prefill_copies(context.cpu_runtime(), (gate, up, down))
        if self.spec.int4_decode and int4 is not None:
            gate = up = down = None  # (the int4 copies are the only weights; the stored bytes are let go)
        self.kernel = MoEKernel(context.cpu_runtime(), experts=E, top_k=self.spec.top_k, hidden=H, intermediate=I,
                                gate=gate, up=up, down=down, name=self.key, int8=int8, int4=int4, tiles=context.cpu_tiles)
        self.pcie = self._pcie_share() if self.spec.pcie_experts else None

    def _prefill_copies(self, runtime, projections) -> tuple:
        """(int8, int4) re-quantized copies of (gate, up, down) for the prefill GEMM, as the spec
        asks, from the bytes just mapped, one expert at a time; (None, None) without them."""
        spec = self.spec
        if not (spec.int8_prefill or spec.int4_group):
            return None, None
        if not runtime.ext.int8_gemm:  # (one warning for all layers: the same message)
            warnings.warn(f"int8_prefill/int4_prefill{'/int4_decode' if spec.int4_decode else ''} is off: the "
                          f"{runtime.isa} CPU kernels have no int8 GEMM (it needs AVX512-VNNI); the experts stay "
                          "as stored", stacklevel=3)
            return None, None
        from ..kernels.cpu import Int4Rows, Int8Rows
        E, H, I = spec.experts, spec.hidden, spec.intermediate
        shapes = ((E, I, H), (E, I, H), (E, H, I))
        if spec.int4_group:
            return None, tuple(Int4Rows.from_blocks(p, s, spec.int4_group) for p, s in zip(projections, shapes))
        return tuple(Int8Rows.from_blocks(p, s) for p, s in zip(projections, shapes)), None

    def _pcie_share(self) -> PcieShare | None:
        """The share pcie_experts asks for, or None (with a warning saying why) where it cannot run;
        "auto" is quietly 0 where the share cannot run or would not pay."""
        n, K = self.spec.pcie_experts, self.spec.top_k
        w = self.kernel._weights
        why = self._pcie_unsupported(w)
        auto = n == "auto"
        if auto:
            n = 0 if why else auto_pcie_experts(self.context, K, sum(p.data.numel() for p in w) // self.spec.experts)
            if n == 0:
                return None
        if not isinstance(n, int) or not 0 < n < K:
            raise ValueError(f"{self.key}: pcie_experts must lie in [0, {K - 1}] (top-k {K}), got {n}")
        if why is None:
            from ..kernels.triton.pcie_experts import HostRegistration
            tiles = tuple(p.data for p in w)
            try:
                return PcieShare(K - n, tuple(p.ggml_type for p in w), tiles, HostRegistration(tiles))
            except RuntimeError as e:  # e.g. the locked-memory limit (ulimit -l) of an unprivileged user
                why = str(e)
        if auto:  # (one warning for all layers: the same message)
            warnings.warn(f"pcie_experts auto is off: {why}; all experts stay on the CPU", stacklevel=2)
        else:
            warnings.warn(f"{self.key}: pcie_experts={n} is off: {why}; all experts stay on the CPU", stacklevel=2)
        return None

    def _pcie_unsupported(self, w) -> str | None:
        """Why the share cannot run on these (gate, up, down) weights here, or None."""
        if not torch.cuda.is_available():
            return "no CUDA device"
        if self.kernel.copies_only:
            return "the experts are int4 copies (int4_decode), which the GPU does not read"
        from ..kernels.triton.pcie_experts import supports
        why = supports(tuple(p.ggml_type for p in w), tuple(p.tiled for p in w), self.spec.hidden,
                       self.spec.intermediate)
        if why is None and not all(isinstance(p.data, torch.Tensor) for p in w):
            why = "the tiles are not torch tensors"
        return why

    def unload(self) -> None:
        if self.pcie is not None:
            self.pcie.registration.close()  # (before the tiles can be freed)
        self.pcie = None
        self.kernel = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return self.kernel.forward(x, ids, weights).to(self.dtype)

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Queue the experts on the CPU threads and return at once; call the result to wait for y."""
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if x.device.type == "cuda":  # in order with the GPU stream (and inside CUDA graphs)
            from ..kernels.cuda_host import submit_on_stream
            return submit_on_stream(self.kernel, self.context.host_staging(), x, ids, weights, self.dtype,
                                    share=self._share(x, ids, weights))
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = self.kernel.submit(x, ids, weights)
        runtime = self.kernel.runtime

        def wait() -> torch.Tensor:
            runtime.sync()
            return y.to(self.dtype)
        return wait

    def stage_inputs(self, x: torch.Tensor):
        """Where a launch before a call fed from x's GPU stream may store the call's inputs in
        passing (the router: HostStaging.pinned_inputs), or None where those launches do not fuse."""
        if self.kernel is None or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
            return None
        staging = self.context.host_staging()
        if not staging.fuses(x.device):
            return None
        col0 = self._share_col0(x)
        return staging.pinned_inputs(self.kernel, x, self.spec.top_k if col0 is None else col0)

    def _share_col0(self, x: torch.Tensor) -> int | None:
        """The first of the columns pcie_experts computes on the GPU for a step like x, or None."""
        from ..kernels.triton.pcie_experts import MAX_TOKENS
        if self.pcie is None or x.dim() != 2 or x.shape[0] > MAX_TOKENS:
            return None
        return self.pcie.col0

    def _share(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """submit_on_stream's `share` for a decode step with pcie_experts, else None."""
        from ..kernels.triton.pcie_experts import pcie_experts
        if self._share_col0(x) is None or any(t.stride(-1) != 1 for t in (x, ids, weights)):
            return None
        share, E, I = self.pcie, self.spec.experts, self.spec.intermediate
        return share.col0, lambda: pcie_experts(x, ids, weights, share.col0, *share.tiles, share.types, E, I)


@EXPERT_OPS.register("KExpertsGPU")
class KExpertsGPU:
    """Experts resident on a CUDA device, computed by the Triton fused-MoE kernel: projections
    stored as Q4_0/Q4_K/Q8_0 become int4/int8 codes losslessly, others bf16. `only` (a list of
    expert ids) keeps a subset (hot experts); ids of experts not held are skipped."""

    def __init__(self, spec: ExpertSpec, device: torch.device, only: list[int] | None = None):
        from ..kernels.triton.common import require
        require(device, f"{spec.key}: KExpertsGPU")
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.only = None if only is None else sorted(int(e) for e in only)
        self.gate_up = self.down = None
        self.local = None  # global expert id -> index here, or -1 (when holding a subset)

    def _projections(self, weights, names: tuple[str, ...], shape: tuple[int, int, int]):
        from ..kernels.triton.fused_moe import stack_group_weights
        from ..weights.ggml_quants import GROUP_AFFINE_TYPES
        keep = self.only
        stored = [weights.raw_stacked(f"{self.key}.{n}_proj") for n in names]
        affine = {int(t) for t in GROUP_AFFINE_TYPES}
        if all(st is not None and st[1].shape == shape and int(st[1].ggml_type) in affine for st in stored) and \
                len({int(st[1].ggml_type) for st in stored}) == 1:
            E = shape[0]
            parts = []
            for raw, info in stored:
                raw = torch.as_tensor(np.asarray(raw).reshape(E, -1))
                if keep is not None:
                    raw = raw[keep]
                parts.append((raw.contiguous(), int(info.ggml_type), (raw.shape[0], *shape[1:])))
            return stack_group_weights(parts).to(self.device)
        dense = [weights.load(f"{self.key}.{n}_proj", dtype=torch.bfloat16, shape=shape) for n in names]
        w = torch.cat(dense, 1) if len(dense) > 1 else dense[0]
        if keep is not None:
            w = w[keep]
        return w.contiguous().to(self.device)

    def load(self, weights, context) -> None:
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        self.gate_up = self._projections(weights, ("gate", "up"), (E, I, H))
        self.down = self._projections(weights, ("down",), (E, H, I))
        if self.only is not None:
            local = torch.full((E,), -1, dtype=torch.int64)
            local[self.only] = torch.arange(len(self.only))
            self.local = local.to(self.device)

    def unload(self) -> None:
        self.gate_up = self.down = self.local = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from ..kernels.triton.fused_moe import fused_moe
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if self.local is not None:
            ids = self.local[ids]
        return fused_moe(x, ids, weights, self.gate_up, self.down).to(self.dtype)


EXPERT_OPS.register("KExpertsMarlin")(KExpertsGPU)  # upstream's name for GPU experts


class PinnedSlots:
    """A ring of page-locked chunks that layer-wise prefill stages stored experts in on their way
    to the GPU: the CPU pool copies the next chunk from the mapped file into the next slot while
    the copies of the slots before it to the GPU (from pinned memory: at the bus's speed, and
    asynchronous) may still be in flight; a slot is refilled once its last copy is done. Shared by
    a model's MoE layers (RunContext.pinned_slots): SLOTS x the chunk of page-locked RAM in all,
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
    -> GPU on a copy stream: pageable memory reached the GPU at ~5 GB/s, one driver thread staging
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
        self.tiles = None  # ((gate, up, down) tile buffers the GPU reads in place, their ggml types)
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

    def _tiles(self, cpu_op):
        """(tile buffers, types) of the CPU experts where the GPU can read them in place (what
        pcie_experts reads: KExpertsCPU._pcie_unsupported says where not), else None."""
        from ..kernels.triton.pcie_experts import HostRegistration
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
        self.tiles = None

    def _copy(self, group: int):
        """Send group `group` to the GPU on the copy stream; (group, event, GPU tensors). From
        tiles: the group in bf16 (gate_up, down), read in place. Else its stored bytes, staged
        chunk by chunk (CPU pool, blocking), each chunk's copy to the GPU enqueued once staged."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        if self.tiles is not None:
            return self._read_tiles(group)
        slots, runtime = self._context.pinned_slots(), self._context.cpu_runtime()
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
        from ..kernels.triton.pcie_experts import dequantize_tiles
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
        from ..kernels.triton.dequant import dequantize  # one launch a tensor (Q4_K, Q6_K, Q8_0)
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
        from ..kernels.triton.fused_moe import fused_moe, fused_moe_block_m
        x, ids, weights = x.to(self.device), ids.to(self.device), weights.to(self.device)
        (T, K), H = ids.shape, x.shape[1]
        pairs = torch.zeros(T * K, H, dtype=torch.float32, device=self.device)
        block_m = fused_moe_block_m(T, K, self.spec.experts)
        for group, (e0, e1) in enumerate(self.groups):
            gate_up, down = self._weights(group)
            local = torch.where((ids >= e0) & (ids < e1), ids - e0, -1)
            fused_moe(x, local, weights, gate_up, down, pairs=pairs, block_m=block_m)
            del gate_up, down  # (freed on the compute stream: the next group's dequantize reuses them)
            self._prefetch_after(group)
        return pairs.view(T, K, H).sum(1)


@dataclass(frozen=True)
class ExpertsOptions(Placement):
    prefill_op: str = field(default="KExpertsTorch", metadata=choices(EXPERT_OPS.names))
    generate_op: str = field(default="KExpertsTorch", metadata=choices(EXPERT_OPS.names))
    out_device: str = device_field()
    int8_prefill: bool = False  # KExpertsCPU: int8 copies of the experts for a faster prefill GEMM
    # KExpertsCPU: int4 copies instead (groups of int4_group columns, a multiple of 64): 0.53 bytes a
    # weight at 128, against int8's 1 (2 with its AMX tiles)
    int4_prefill: bool = False
    int4_group: int = 128
    # KExpertsCPU: the int4 copies are the experts' only weights, for decode too (implies int4_prefill):
    # for BF16/FP8 checkpoints, whose experts would otherwise be kept in bf16 (0.53 bytes a weight, not 2)
    int4_decode: bool = False
    # hot experts: this many of the layer's experts also live on a GPU (KExpertsGPU) and the
    # router's choices are split between it and the CPU op (when the phase's op runs on the CPU)
    num_gpu_experts: int = 0
    gpu_experts_device: str | None = device_field(None)  # default: out_device when CUDA, else cuda
    expert_counts_file: str | None = None  # JSON of routing counts (bench/calibrate); without it: uniform
    # prefill chunks of at least this many tokens stream the layer's stored experts to the GPU and
    # compute there (LayerwisePrefill; 0: never); --prefill_gpu_threshold overrides it
    prefill_gpu_threshold: int = 0
    # layer-wise prefill dequantizes a layer's experts in groups of at most this many MiB of bf16
    # (the GPU holds about twice that for it; one expert at least)
    prefill_gpu_group_mb: int = field(default=LAYERWISE_GROUP_MB, metadata={"min": 1})
    # KExpertsCPU decoding from a GPU: of each token's top-k experts, the GPU computes this many
    # from the CPU's own tiles, read in place over PCIe while the CPU threads compute the rest
    # (kernels/triton/pcie_experts.py; 0: all on the CPU; "auto": auto_pcie_experts).
    # KT_PCIE_EXPERTS overrides it.
    pcie_experts: int | str = 0


def hot_experts(key: str, n: int, experts: int, counts_file: str | None) -> list[int]:
    """The `n` most routed experts of layer `key` by a counts file ({key: [count per expert]}),
    ties (and no file: uniform counts) broken by the lower id."""
    if not 0 <= n <= experts:
        raise ValueError(f"{key}: num_gpu_experts must lie in [0, {experts}], got {n}")
    counts = [0] * experts
    if counts_file:
        import json
        try:
            with open(counts_file) as f:
                table = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: cannot read expert_counts_file {counts_file!r}: {e}") from None
        counts = table.get(key, counts)
        if len(counts) != experts:
            raise ValueError(f"{key}: {counts_file} has {len(counts)} counts for {experts} experts")
    return sorted(sorted(range(experts), key=lambda e: (-counts[e], e))[:n])


@register_operator("KTransformersExperts")
class KTransformersExperts(BaseInjectedModule):
    """HF experts' forward(hidden_states, top_k_index, top_k_weights) -> [T, H] on out_device."""

    Options = ExpertsOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        E, two_i, H = orig_module.gate_up_proj.shape
        self.n_experts = E
        top_k = getattr(config, "num_experts_per_tok", None) or E
        o = self.options
        pcie = os.environ.get("KT_PCIE_EXPERTS", o.pcie_experts)  # (the environment: for A/B runs)
        if isinstance(pcie, str) and (pcie := pcie.strip()) != "auto":
            try:
                pcie = int(pcie)
            except ValueError:
                raise ValueError(f"{key}: pcie_experts (or KT_PCIE_EXPERTS) must be an integer or 'auto', "
                                 f"got {pcie!r}") from None
        if pcie != 0 and o.num_gpu_experts:
            # (the two together were not measured, and their one GPU test did not pass: off)
            if pcie != "auto":
                warnings.warn(f"{key}: pcie_experts is off beside num_gpu_experts; all non-hot experts stay on "
                              "the CPU", stacklevel=2)
            pcie = 0
        spec = ExpertSpec(key, E, H, two_i // 2, top_k, orig_module.gate_up_proj.dtype, o.int8_prefill, pcie,
                          int4_group=self._int4_group(key, H, two_i // 2), int4_decode=o.int4_decode)
        self.ops = {"prefill": EXPERT_OPS.get(o.prefill_op)(spec, torch.device(o.prefill_device))}
        same = (o.prefill_op, o.prefill_device) == (o.generate_op, o.generate_device)
        self.ops["generate"] = self.ops["prefill"] if same else EXPERT_OPS.get(o.generate_op)(
            spec, torch.device(o.generate_device))
        self.hot = None  # KExpertsGPU over the hot experts, with their mask [E] on its device
        if o.num_gpu_experts:
            device = o.gpu_experts_device or (o.out_device if o.out_device.startswith("cuda") else "cuda")
            ids = hot_experts(key, o.num_gpu_experts, E, o.expert_counts_file)
            self.hot = KExpertsGPU(spec, torch.device(device), only=ids)
            self.hot_mask = torch.zeros(E, dtype=torch.bool)
            self.hot_mask[ids] = True
        self.layerwise = None  # LayerwisePrefill, when prefill chunks may run on the GPU
        if o.prefill_gpu_threshold and o.out_device.startswith("cuda"):
            self.layerwise = LayerwisePrefill(spec, torch.device(o.out_device), o.prefill_gpu_group_mb)

    def _int4_group(self, key: str, hidden: int, intermediate: int) -> int:
        """ExpertSpec.int4_group from the options (0 without int4_prefill or int4_decode), checked
        against the shapes."""
        o = self.options
        if not (o.int4_prefill or o.int4_decode):
            return 0
        if o.int8_prefill:
            raise ValueError(f"{key}: int8_prefill and int4_prefill/int4_decode are alternatives; set one")
        g = o.int4_group
        if g <= 0 or g % 64 or hidden % g or intermediate % g or intermediate % 16:
            raise ValueError(f"{key}: int4_group must be a multiple of 64 dividing hidden ({hidden}) and "
                             f"intermediate ({intermediate}), got {g}")
        return g

    def _threshold(self) -> int:
        ctx = self.context
        override = getattr(ctx, "prefill_gpu_threshold", None) if ctx is not None else None
        return self.options.prefill_gpu_threshold if override is None else override

    def load(self) -> None:
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(self.weights, self.run_context())
        if self.hot is not None:
            self.hot.load(self.weights, self.run_context())
            self.hot_mask = self.hot_mask.to(self.hot.device)
        if self.layerwise is not None:
            self.layerwise.load(self.weights, self.run_context(), self.ops["generate"])

    def unload(self) -> None:
        if self.layerwise is not None:  # (its registration of the CPU op's tiles first)
            self.layerwise.unload()
        for op in self.ops.values():
            op.unload()
        if self.hot is not None:
            self.hot.unload()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """y [T, H] on out_device, nothing to overlap: a CPU op runs on the calling thread with
        the pool (no hand-off to its task thread and back)."""
        return self.submit(hidden_states, top_k_index, top_k_weights, overlap=False)()

    def stage_inputs(self, hidden_states: torch.Tensor):
        """The pinned views (triton.handoff.PinnedInputs) a router launch may store this step's
        inputs in, where the op is the CPU experts fed from this GPU stream and nothing comes
        between the router and them (no hot-expert split, no layer-wise prefill); else None."""
        op = self.ops[self.phase]
        if self.hot is not None or not hasattr(op, "stage_inputs"):
            return None
        threshold = self._threshold() if self.layerwise is not None else 0
        if threshold and self.phase == "prefill" and hidden_states.shape[0] >= threshold:
            return None
        return op.stage_inputs(hidden_states)

    def submit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               overlap: bool = True):
        """Start the experts and return a function that waits for y [T, H] on out_device. A CPU op
        runs on its threads meanwhile (the caller computes shared experts, the hot experts run
        on the GPU); other ops finish before this returns. `overlap=False`: the caller has nothing
        to do meanwhile, so a CPU op fed from the CPU runs inline."""
        op = self.ops[self.phase]
        threshold = self._threshold() if self.layerwise is not None else 0
        if threshold and self.phase == "prefill" and hidden_states.shape[0] >= threshold:
            y = self.layerwise.forward(hidden_states, top_k_index, top_k_weights)
            out_y = y.to(self.options.out_device, hidden_states.dtype)
            return lambda: out_y
        capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        if not getattr(op, "checks_routing", False) and not capturing:  # (C++ ops check ids; a graph may not sync)
            check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
        out, dtype = torch.device(self.options.out_device), hidden_states.dtype
        split = self.hot is not None and op.device.type == "cpu"
        ids = top_k_index
        if split:  # pairs of hot experts go to the GPU; the CPU op skips them (id -1)
            if hidden_states.device.type != "cuda":  # (on a GPU stream the C++ kernel checks the ids)
                check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
            on_gpu = self.hot_mask[top_k_index.to(self.hot.device)]
            ids = top_k_index.masked_fill(on_gpu.to(top_k_index.device), -1)
        # a CPU op fed from a GPU stream takes the GPU tensors (it stages them itself)
        where = hidden_states.device if op.device.type == "cpu" and hidden_states.device.type == "cuda" else op.device
        args = (hidden_states.to(where), ids.to(where), top_k_weights.to(where))
        if hasattr(op, "submit") and (overlap or split or where.type == "cuda"):
            pending = op.submit(*args)
        else:
            y = op.forward(*args)
            pending = lambda: y  # noqa: E731
        gpu_y = None
        if split:
            dev = self.hot.device
            try:
                gpu_y = self.hot.forward(hidden_states.to(dev), top_k_index.to(dev), top_k_weights.to(dev))
            except BaseException:
                pending()  # the CPU call started above is waited for (see KMoEBlock.forward)
                raise

        def wait() -> torch.Tensor:
            y = pending().to(out, dtype)
            return y if gpu_y is None else y + gpu_y.to(out, dtype)
        return wait
