"""Where a layer's routed experts compute besides the CPU op: hot experts resident on a GPU, and
the bus share (of each decode token's top-k experts, the GPU computes some from the CPU's own
tiles, read in place over PCIe, while the cores compute the rest), with the share's cost model.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class BusShareCosts:
    """The constants of the bus share's cost model. The two read rates it weighs are measured at
    load (the bus's reads of pinned host memory, the CPU pool's stream); these fractions of them,
    and the GPU's fixed cost, were fitted to decode runs of a Qwen3-30B-A3B-shaped model on a
    16-core Sapphire Rapids host with an H200 (docs/gpu.md), where 2 of 8 experts on the bus
    decoded faster than none and 3 slower."""

    gpu_overhead_s: float = 25e-6  # the share's two launches and the bus's first bytes
    cpu_kernel: float = 0.8  # the CPU kernel's read rate at one token, of the pool's stream
    cpu_beside_bus: float = 0.85  # the kernel's rate while the bus reads the same memory, of the above
    bus_beside_cpu: float = 0.65  # the bus's rate beside the streaming cores, of its rate alone
    # "auto" measures nothing and takes no share of experts smaller than this (tiny models): their
    # top-k on the CPU cost about the GPU's fixed cost or less
    min_expert_bytes: int = 1 << 20


BUS_SHARE_COSTS = BusShareCosts()


def pcie_share_size(top_k: int, expert_bytes: int, bus_gbps: float, cpu_gbps: float,
                    costs: BusShareCosts = BUS_SHARE_COSTS) -> int:
    """The share n of a token's top_k experts (each expert_bytes of weights) that makes the slower
    of the two sides quickest: the GPU's fixed cost + n experts over the bus, against the CPU's
    top_k - n experts at its kernel's rate, slower while the bus reads the same memory; ties: the
    smaller n. 0 where the share does not pay, e.g. where all top_k experts on the CPU take less
    than the GPU's fixed cost."""
    cpu = cpu_gbps * costs.cpu_kernel * 1e9
    bus = bus_gbps * costs.bus_beside_cpu * 1e9

    def step(n: int) -> float:
        reading = n * expert_bytes / bus  # the bus's reads, beside which the cores are slower
        cpu_bytes = (top_k - n) * expert_bytes
        beside = reading * cpu * costs.cpu_beside_bus  # what the cores read meanwhile
        if cpu_bytes <= beside:
            cpu_s = cpu_bytes / (cpu * costs.cpu_beside_bus)
        else:
            cpu_s = reading + (cpu_bytes - beside) / cpu
        return max(costs.gpu_overhead_s + reading if n else 0.0, cpu_s)
    return min(range(top_k), key=lambda n: (step(n), n))


def auto_pcie_experts(context, top_k: int, expert_bytes: int, costs: BusShareCosts = BUS_SHARE_COSTS) -> int:
    """pcie_experts "auto": pcie_share_size at the rates with which the bus and the CPU's threads
    read host memory, measured once per run context (a short probe, the first time a layer asks)."""
    if expert_bytes < costs.min_expert_bytes:
        return 0
    rates = context.pcie_rates
    if rates is None:
        from ...kernels.triton.pcie_experts import bus_read_gbps
        try:
            rates = bus_read_gbps(torch.device("cuda")), context.cpu_runtime().stream_gbps(1.0, 3)
        except Exception as e:  # (pinned memory refused, no Triton for this GPU, out of memory...)
            warnings.warn(f"pcie_experts auto is off: measuring the bus's and the CPU's read rates failed: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
            rates = (0.0, 1.0)
        context.pcie_rates = rates
    bus, cpu = rates
    return pcie_share_size(top_k, expert_bytes, bus, cpu, costs) if bus > 0 else 0


class PcieShare(NamedTuple):
    """KExpertsCPU's pcie_experts in use: the GPU computes the pairs of top-k columns col0.. from
    the kernel's tiles (their ggml types), page-locked by `registration` while loaded."""
    col0: int
    types: tuple[int, int, int]
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    registration: object  # kernels.triton.pcie_experts.HostRegistration


def parse_pcie_experts(key: str, value) -> int | str:
    """The pcie_experts kwarg as an int or "auto"."""
    if isinstance(value, str) and (value := value.strip()) != "auto":
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{key}: pcie_experts must be an integer or 'auto', got {value!r}") from None
    return value


class ExpertPlacement:
    """A layer's hot experts (`hot`: sorted ids resident on a GPU, or None) and its bus share
    (`pcie`: how many of each decode token's top-k the GPU computes from the CPU's tiles, or
    "auto" for the cost model's choice at load). The two are not combined: beside hot experts
    the share is off."""

    def __init__(self, key: str, experts: int, num_gpu_experts: int, counts_file: str | None, pcie_experts):
        self.hot = hot_experts(key, num_gpu_experts, experts, counts_file) if num_gpu_experts else None
        pcie = parse_pcie_experts(key, pcie_experts)
        if pcie != 0 and self.hot is not None:
            if pcie != "auto":
                warnings.warn(f"{key}: pcie_experts is off beside num_gpu_experts; all non-hot experts stay on "
                              "the CPU", stacklevel=3)
            pcie = 0
        self.pcie = pcie


MAX_COUNTS_BYTES = 64 << 20  # an expert_counts_file: a few numbers per expert and layer


def hot_experts(key: str, n: int, experts: int, counts_file: str | None) -> list[int]:
    """The `n` most routed experts of layer `key` by a counts file ({key: [count per expert]}),
    ties (and no file: uniform counts) broken by the lower id."""
    if not 0 <= n <= experts:
        raise ValueError(f"{key}: num_gpu_experts must lie in [0, {experts}], got {n}")
    counts = [0] * experts
    if counts_file:
        path = Path(counts_file)
        if not path.is_file() or path.stat().st_size > MAX_COUNTS_BYTES:
            raise ValueError(f"{key}: expert_counts_file {counts_file!r} must be a regular file of at most "
                             f"{MAX_COUNTS_BYTES} bytes")
        try:
            with open(path) as f:
                table = json.loads(f.read(MAX_COUNTS_BYTES + 1))
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: cannot read expert_counts_file {counts_file!r}: {e}") from None
        if not isinstance(table, dict):
            raise ValueError(f"{key}: expert_counts_file {counts_file!r} must hold an object of layer -> counts")
        counts = table.get(key, counts)
        if (not isinstance(counts, list) or len(counts) != experts
                or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts)):
            n = len(counts) if isinstance(counts, list) else "no list of"
            raise ValueError(f"{key}: {counts_file} has {n} counts for {experts} experts")
    return sorted(sorted(range(experts), key=lambda e: (-counts[e], e))[:n])
