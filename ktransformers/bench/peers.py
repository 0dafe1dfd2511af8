"""Peers run beside ours in the same benchmark process, when installed: kt-kernel (upstream's
CPU kernels, PyPI `kt-kernel`). Driven through its extension module directly (its high-level
wrapper wants CUDA pinned memory)."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import statistics
import sys
import time

import torch

_GGML_IDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "Q4_0": 2, "IQ4_XS": 23, "BF16": 30, "F16": 1}


def kt_kernel_ext():
    """kt-kernel's extension module, or None when it is not installed or cannot load here."""
    try:
        from kt_kernel import kt_kernel_ext as ext
        return ext
    except Exception:  # not installed, or no variant for this CPU
        return None


class KTKernelMoE:
    """One MoE layer in kt-kernel, on the same weight bytes as ours: one kt-kernel layer per copy
    of ours (its pool shared by them), cycled call by call as ours are, so that both read the
    same footprint (a layer that fits a large L3 would otherwise be timed from the cache)."""

    def __init__(self, threads: int, *, experts: int, top_k: int, hidden: int, intermediate: int,
                 types: tuple[str, str, str], copies: list[tuple], max_tokens: int = 512, klass: str = "MOE"):
        """`copies`: (gate, up, down) weights of each copy. klass "MOE": GGML blocks of `types`; an
        AMX class (AMXBF16_MOE, AMXInt8_MOE, AMXInt4_MOE, AMXInt4_KGroup_MOE): bf16 weights,
        which it quantizes itself when loading."""
        ext = kt_kernel_ext()
        wc = ext.WorkerPoolConfig()
        wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [threads]
        self.cpu = ext.CPUInfer(wc)
        self.top_k = top_k
        self._expert_ids = torch.arange(experts, dtype=torch.int64)
        self._keep, self.moes = [], []
        for gate, up, down in copies:
            cfg = ext.moe.MOEConfig(experts, top_k, hidden, intermediate, 0)
            cfg.pool, cfg.max_len = self.cpu.backend_, max_tokens
            self._keep.append((gate, up, down))
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in (gate, up, down))
            if klass != "MOE":
                moe = getattr(ext.moe, klass)(cfg)
            elif types == ("BF16",) * 3:
                moe = ext.moe.AMXBF16_MOE(cfg)
            else:
                cfg.gate_type, cfg.up_type, cfg.down_type = (_GGML_IDS[t] for t in types)
                cfg.hidden_type, cfg.m_block, cfg.group_min_len, cfg.group_max_len = 30, 32, 10, max_tokens
                moe = ext.moe.MOE(cfg)
            self.cpu.submit(moe.load_weights_task(self._expert_ids.data_ptr()))
            self.cpu.sync()
            self.moes.append(moe)

    @property
    def copies(self) -> int:
        return len(self.moes)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, call: int = 0) -> torch.Tensor:
        """Call number `call` (its copy: call % copies, as ours cycle theirs)."""
        x = x.to(torch.bfloat16).contiguous()
        ids, weights = ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        qlen = torch.tensor([x.shape[0]], dtype=torch.int32)
        moe = self.moes[call % len(self.moes)]
        self.cpu.submit(moe.forward_task(qlen.data_ptr(), self.top_k, ids.data_ptr(), weights.data_ptr(),
                                         x.data_ptr(), y.data_ptr(), False))
        self.cpu.sync()
        return y


@contextlib.contextmanager
def quiet_stdout():
    """kt-kernel greets on stdout from C++; keep JSON output clean by sending fd 1 to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def kt_kernel_version() -> str:
    try:
        return "kt-kernel " + importlib.metadata.version("kt-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "kt-kernel"


def build_peers(threads_options, **layer) -> dict[int, KTKernelMoE]:
    """kt-kernel layers for each thread count ({} when kt-kernel is absent or refuses the case)."""
    if kt_kernel_ext() is None:
        return {}
    peers = {}
    with quiet_stdout():
        for threads in threads_options:
            try:
                peers[threads] = KTKernelMoE(threads, **layer)
            except Exception:
                return {}
    return peers


AMX_CLASSES = ("AMXInt8_MOE", "AMXInt4_MOE", "AMXBF16_MOE")


def time_peers(peers: dict[int, KTKernelMoE], calls: list[tuple]) -> dict | None:
    """The best median over thread counts (its spinning task thread can make 2 threads slower
    than 1 on a machine with few cores): {name (with class and thread count), median_us}, or None."""
    best = None
    with quiet_stdout():
        for threads, peer in peers.items():
            times = []
            for i, (x, ids, w) in enumerate(calls):
                start = time.perf_counter()
                peer.forward(x, ids, w, i)
                if i >= 2:  # warm-up
                    times.append(time.perf_counter() - start)
            median = statistics.median(times)
            if best is None or median < best[1]:
                best = (threads, median)
    if best is None:
        return None
    peer = next(iter(peers.values()))
    klass = type(peer.moes[0]).__name__
    name = kt_kernel_version() + ("" if klass in ("MOE", "AMXBF16_MOE") and not getattr(peer, "extra", False) else f" {klass}")
    return {"name": f"{name}, {best[0]} threads", "median_us": best[1] * 1e6, "copies": peer.copies}
