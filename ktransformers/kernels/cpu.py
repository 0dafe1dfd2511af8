"""Python face of the C++ CPU kernels: ISA dispatch, the runtime (thread pool), MoE and linear.

Shapes: x [T, H] float32 or bfloat16; top_k_index [T, K] int64; top_k_weights [T, K] float32;
gate/up weights [E, I, H] and down [E, H, I] as raw GGML blocks (uint8 arrays, zero-copy views
of the GGUF memory map where possible; MoEKernel/LinearKernel repack Q4_K/Q5_K/Q6_K/IQ4_XS/Q8_0
into 16-row tiles unless tiles=False). Every tensor is checked here (dtype, shape, contiguity,
expert ids) and again in C++ (byte counts, ids) before any memory is touched.

The ISA level is the best the CPU has; KT_CPU_ISA forces a lower one (ktransformers.environment).
BF16 weights take the best kernel the CPU runs (AMX-BF16 tiles for blocks of >= 4 tokens, else
AVX512-BF16 dot products, else every bf16 widened to float32) unless CPURuntime's bf16_kernel
allows less. CPU experts fed from a CUDA stream: kernels/cuda_host.py.
"""
from __future__ import annotations

import importlib
import math
import mmap
import os
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import environment

ISA_ORDER = environment.CPU_ISAS  # best first
# ggml type -> how the kernels prepare activations for it: the block over which they are quantized
# to int8, BF16_ACTIVATIONS (rounded to bf16: BF16 weights) or None (kept float32). Mirrors
# csrc/quants.cpp's format table; round_activations below rounds them the same way.
BF16_ACTIVATIONS = "bf16"
ACTIVATION_BLOCK = {0: None, 1: None, 30: BF16_ACTIVATIONS, 8: 32, 2: 32, 10: 256, 11: 256, 12: 256, 13: 256, 14: 256,
                    23: 256, 39: 32}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _features() -> set[str]:
    """CPU features the OS lets us use, as lower-case /proc/cpuinfo names. cpufeature (CPUID plus
    the OS's XSAVE state) where it is installed; /proc/cpuinfo (which Linux already filters) always,
    since cpufeature does not report AMX or AVX512-BF16."""
    flags = _cpu_flags()
    try:
        import cpufeature
    except ImportError:
        return flags
    f = cpufeature.CPUFeature
    names = {"AVX2": "avx2", "FMA3": "fma", "AVX512f": "avx512f", "AVX512bw": "avx512bw", "AVX512vl": "avx512vl",
             "AVX512dq": "avx512dq", "AVX512vnni": "avx512_vnni"}
    from_cpuid = {flag for key, flag in names.items() if f.get(key)}
    if not f.get("OS_AVX"):
        return set()
    if not f.get("OS_AVX512"):
        from_cpuid = {n for n in from_cpuid if not n.startswith("avx512")}
    return from_cpuid | {n for n in flags if n.startswith("amx") or n in ("avx512_bf16", "avx_vnni")}


@lru_cache(maxsize=1)
def supported_isas() -> tuple[str, ...]:
    """ISA levels this CPU can run, best first."""
    f = _features()
    have = []
    if {"avx2", "fma"} <= f:
        have.append("avx2")
        if "avx_vnni" in f:  # vpdpbusd on 256-bit registers (Alder Lake and newer, Zen 4)
            have.append("avxvnni")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= f:
            have.append("avx512")
            if {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= f:
                have.append("amx")
    return tuple(isa for isa in ISA_ORDER if isa in have)


def default_isa() -> str:
    """The best ISA level this CPU has, or the one KT_CPU_ISA forces (which the CPU must have)."""
    forced = environment.cpu_isa()
    have = supported_isas()
    if not have:
        raise RuntimeError("this CPU lacks AVX2+FMA, the lowest level the CPU kernels are built for")
    if forced is None:
        return have[0]
    if forced not in have:
        raise ValueError(f"KT_CPU_ISA={forced!r}: this CPU supports only {', '.join(have)}")
    return forced


def load_extension(isa: str | None = None):
    isa = isa or default_isa()
    if isa not in supported_isas():
        raise ValueError(f"ISA {isa!r} is not supported by this CPU (supported: {', '.join(supported_isas())})")
    try:
        return importlib.import_module(f"ktransformers.kernels._cpu_{isa}")
    except ImportError as e:
        raise ImportError(f"the CPU kernels for {isa} are not built ({e}); reinstall with `pip install -e .`") from None


BF16_KERNELS = ("widen", "dot", "amx")  # the extension's order: each runs where the one before does


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_list(text: str) -> list[int]:
    """Linux's CPU list syntax ("0-3,8,10-11") as numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def pin_order(allowed: list[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """The CPUs to bind the pool's threads to, in the order threads take them: the first hardware
    thread of each physical core, the fastest cores first (a hybrid CPU's P-cores before its
    E-cores, by the capacity Linux gives each core, else its highest clock), then the cores' second threads. Two busy threads on one
    core's siblings share its load ports, and a thread on an E-core is a slower share of the same
    work: the kernels stream weights, so each thread should have a core of its own, the best ones
    first. Where sysfs says nothing (not Linux, a container hiding it), `allowed` in its order."""
    cores: dict[tuple, list[int]] = {}
    for cpu in sorted(allowed):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            siblings = tuple(_cpu_list((topology / "thread_siblings_list").read_text()))
        except (OSError, ValueError):
            siblings = (cpu,)
        cores.setdefault(siblings, []).append(cpu)
    def speed(siblings: tuple) -> tuple[int, int]:  # (the scheduler's capacity, the highest clock)
        return (max((_read_int(sysfs / f"cpu{c}" / "cpu_capacity") or 0) for c in siblings),
                max((_read_int(sysfs / f"cpu{c}" / "cpufreq" / "cpuinfo_max_freq") or 0) for c in siblings))
    ranked = sorted(cores.items(), key=lambda item: (tuple(-v for v in speed(item[0])), item[1][0]))
    order: list[int] = []
    for depth in range(max((len(cpus) for cpus in cores.values()), default=0)):
        order.extend(cpus[depth] for _, cpus in ranked if depth < len(cpus))
    return order


class CPURuntime:
    """The thread pool and the queue of CPU jobs. submit() returns at once; sync() waits."""

    def __init__(self, threads: int | None = None, isa: str | None = None, pin: bool = True, spin_us: int = 300,
                 bf16_kernel: str = "amx"):
        """`spin_us`: how long idle workers spin before sleeping: shorter leaves more of a small
        machine to other threads (a server's HTTP loop). `bf16_kernel` (widen, dot, amx): the
        best kernel the MoE and linear kernels made on this runtime may use for BF16 weights
        (the best of those this CPU runs: self.bf16_kernel); tests lower it to check each
        against the reference."""
        if bf16_kernel not in BF16_KERNELS:
            raise ValueError(f"bf16_kernel={bf16_kernel!r}: expected one of {', '.join(BF16_KERNELS)}")
        if spin_us < 0:
            raise ValueError(f"spin_us={spin_us}: must be >= 0")
        self.ext = load_extension(isa)
        self.isa = self.ext.isa
        self.bf16_kernel = BF16_KERNELS[min(BF16_KERNELS.index(bf16_kernel), self.ext.bf16_best())]
        allowed = sorted(os.sched_getaffinity(0))
        self.threads = threads or len(allowed)
        self.cpus = pin_order(allowed) if pin else []  # thread i runs on cpus[i % len(cpus)]
        self._rt = self.ext.Runtime(self.threads, self.cpus, spin_us)
        self._keep: list = []  # tensors a submitted job reads or writes, alive until sync()

    def hold(self, *tensors) -> None:
        self._keep.extend(tensors)

    def sync(self) -> None:
        try:
            self._rt.sync()
        finally:
            self._keep.clear()

    def probe_buffer(self, gib: float = 2.0):
        """A buffer of `gib` GiB for stream_gbps, allocated as the weights' are, every page
        written (real)."""
        buf = weight_empty(int(gib * 2**30)).numpy()
        buf.fill(7)
        return buf

    def stream_gbps(self, gib: float = 2.0, repeats: int = 5, buffer=None) -> float:
        """Best-of-N rate (GB/s) at which the pool's threads read a buffer much larger than the
        caches (the CPU's memory-bandwidth probe): `buffer` (from probe_buffer), else a new one of
        `gib` GiB, freed after. Benchmarks that probe again and again keep one buffer: calls
        right after a fresh buffer was written and freed can read much slower."""
        import time
        buf = self.probe_buffer(gib) if buffer is None else buffer
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            self._rt.stream_checksum(buf.ctypes.data, buf.nbytes)
            best = max(best, buf.nbytes / (time.perf_counter() - start) / 1e9)
        return best

    def copy(self, dst: torch.Tensor, src) -> None:
        """dst[:] = src's bytes, copied by every pool thread (src: a contiguous CPU tensor or
        numpy array, e.g. a view of the mapped GGUF; dst: a contiguous CPU tensor of as many bytes)."""
        (d, nd), (s, ns) = _address(dst), _address(src)
        if nd != ns:
            raise ValueError(f"copy: {ns} source bytes into a {nd}-byte destination")
        if nd:
            self._rt.copy(d, s, nd)


def _copy_bytes(rows) -> int:
    """Bytes of an int8/int4 copy's tensors a call reads (its values once: the rows or their AMX tiles)."""
    values = getattr(rows, "w", None)
    return sum(t.numel() * t.element_size() for f, t in vars(rows).items()
               if isinstance(t, torch.Tensor) and not (f == "amx" and values is not None))


def _address(data) -> tuple[int, int]:
    """(address, byte count) of a contiguous uint8 numpy array or torch tensor."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("weight bytes must be a contiguous CPU tensor")
        return data.data_ptr(), data.numel() * data.element_size()
    array = np.asarray(data)
    if not array.flags.c_contiguous:
        raise ValueError("weight bytes must be contiguous")
    return array.ctypes.data, array.nbytes


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64)


def weight_empty(shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """torch.empty for the bytes the CPU kernels stream through (tiles, int8/int4 copies, the
    bandwidth probe): private anonymous memory that asks Linux for 2 MiB transparent huge pages
    (MADV_HUGEPAGE; honoured where THP is 'madvise' or 'always'). A decode step reads tens of MB
    scattered over the experts; on 4 KiB pages that is thousands of TLB misses a step, each a page
    walk (two levels of them in a VM) that the streaming reads wait behind. Buffers under 2 MiB,
    and systems without madvise, get plain torch.empty."""
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # (shared would be shmem: no THP)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: 4 KiB pages, as torch.empty's
        pass
    base = torch.frombuffer(region, dtype=torch.uint8)  # (holds the mapping until its views are gone)
    start = -base.data_ptr() % HUGE_PAGE
    return base[start:start + nbytes].view(dtype).view(shape)


# The buffers tile_weights made, by id: (a weak reference to the buffer, ggml type, rows, cols).
# Tiles and rows of a type have the same size, so bytes cannot tell which they are: only a
# buffer tile_weights wrote is taken as tiles.
_TILED: dict[int, tuple[weakref.ref, int, int, int]] = {}


def _tiling_of(data) -> tuple[int, int, int] | None:
    """(ggml type, rows, cols) of a buffer tile_weights made, else None."""
    entry = _TILED.get(id(data))
    return entry[1:] if entry is not None and entry[0]() is data else None


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of all experts as stored: raw bytes + ggml type id. `tiled`: the bytes are
    the kernels' 16-row tiles of that type, as tile_weights made them (only its buffers are
    accepted as tiles), not the GGUF's rows."""
    data: object  # uint8 numpy array (memmap view) or torch tensor
    ggml_type: int
    tiled: bool = False

    def __post_init__(self):
        tiling = _tiling_of(self.data) if self.tiled else None
        if self.tiled and (tiling is None or tiling[0] != self.ggml_type):
            raise ValueError(f"ExpertWeights(tiled=True): the bytes are not tiles tile_weights made for ggml type "
                             f"{self.ggml_type}; pass the rows as stored (tiled=False): the kernels tile them")

    def check_tiling(self, name: str, rows: int, cols: int) -> None:
        """Raise ValueError (naming `name`) unless tiled bytes were tiled as rows x cols."""
        tiling = _tiling_of(self.data) if self.tiled else None
        if tiling is not None and tiling[1:] != (rows, cols):
            raise ValueError(f"{name}: its tiles were made for {tiling[1]} x {tiling[2]} values, not {rows} x {cols}")

    def kernel_type(self, ext) -> int:
        """The type id the C++ kernels take: the ggml type, flagged when tiled."""
        return self.ggml_type | ext.tiled_flag if self.tiled else self.ggml_type


def tile_weights(runtime: CPURuntime, weights: ExpertWeights, rows: int, cols: int) -> ExpertWeights:
    """`weights` (rows x cols values in all, rows of GGML blocks) repacked once into the 16-row
    tiles this build computes on without horizontal sums (same byte count, a new tensor), where
    it has them for the type and rows % 16 == 0; otherwise `weights` itself."""
    from ..weights.ggml_quants import tensor_nbytes
    step = runtime.ext.tile_cols(weights.ggml_type)
    if weights.tiled or not step or rows % 16 or cols % step:
        return weights
    src, nbytes = _address(weights.data)
    if nbytes != tensor_nbytes(weights.ggml_type, rows * cols):
        return weights  # not the matrix the caller says: its kernel's constructor names what is wrong
    out = weight_empty(nbytes)
    runtime._rt.repack_tiles(weights.ggml_type, src, nbytes, out.data_ptr(), nbytes, rows, cols)
    key = id(out)
    _TILED[key] = (weakref.ref(out, lambda _, key=key: _TILED.pop(key, None)), weights.ggml_type, rows, cols)
    return ExpertWeights(out, weights.ggml_type, tiled=True)


def _check_tilings(name: str, weights, experts: int, hidden: int, intermediate: int) -> None:
    """Tiled gate, up and down (None: absent) must have been tiled for all experts' rows."""
    shapes = ((experts * intermediate, hidden), (experts * intermediate, hidden), (experts * hidden, intermediate))
    for w, what, (rows, cols) in zip(weights, ("gate", "up", "down"), shapes):
        if w is not None:
            w.check_tiling(f"{name} {what}", rows, cols)


@dataclass(frozen=True)
class Int8Rows:
    """A projection of all experts re-quantized for the int8 prefill GEMM: w [E, rows, cols]
    int8, one float scale per row, and each row's sum of int8 values; on AMX builds the values
    may live in the AMX tiles alone (pack_amx: w None)."""
    w: torch.Tensor | None
    scale: torch.Tensor
    row_sum: torch.Tensor
    amx: torch.Tensor | None = None  # the values packed in AMX tiles (pack_amx), for AMX builds

    def __post_init__(self):  # the kernel reads float32 scales and int32 sums
        if self.w is None and self.amx is None:
            raise ValueError("Int8Rows needs its values: the rows w or their AMX tiles")
        object.__setattr__(self, "scale", self.scale.to(torch.float32).contiguous())
        object.__setattr__(self, "row_sum", self.row_sum.to(torch.int32).contiguous())

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, rows, cols)"""
        if self.w is not None:
            return tuple(self.w.shape)
        E, blocks, col_tiles = self.amx.shape[:3]
        return E, blocks * 16, col_tiles * 64

    def pack_amx(self) -> Int8Rows:
        """The copy as AMX tiles alone, in place of the rows (the kernels split rows in whole
        16-row blocks, which the tiles hold): [E, rows/16, cols/64, 16, 64], tile row kk =
        w[n, 4kk:4kk+4] for n = 0..15. Unchanged where the shape has no whole tiles."""
        if self.amx is not None:
            return self
        E, rows, cols = self.w.shape
        if rows % 16 or cols % 64:
            return self
        tiles = weight_empty((E, rows // 16, cols // 64, 16, 16, 4), torch.int8)
        tiles.copy_(self.w.reshape(E, rows // 16, 16, cols // 64, 16, 4).permute(0, 1, 3, 4, 2, 5))
        return Int8Rows(None, self.scale, self.row_sum, tiles.reshape(E, rows // 16, cols // 64, 16, 64))

    def rows(self) -> torch.Tensor:
        """w [E, rows, cols] int8 (unpacked from the AMX tiles where only those are kept)."""
        if self.w is not None:
            return self.w
        E, rows, cols = self.shape
        return self.amx.reshape(E, rows // 16, cols // 64, 16, 16, 4).permute(0, 1, 4, 2, 3, 5).reshape(E, rows, cols)

    @staticmethod
    def from_experts(shape: tuple[int, int, int], expert) -> Int8Rows:
        """Symmetric per-row int8 of E experts' float weights, `expert(e)` -> [rows, cols], one
        expert at a time (no float copy of the whole stack)."""
        E, rows, cols = shape
        w = weight_empty((E, rows, cols), torch.int8)
        scale = torch.empty(E, rows, dtype=torch.float32)
        for e in range(E):
            d = expert(e).float()
            s = d.abs().amax(dim=1) / 127.0
            w[e] = torch.round(d / torch.where(s > 0, s, torch.ones_like(s))[:, None]).to(torch.int8)
            scale[e] = s
        return Int8Rows(w, scale, w.sum(dim=2, dtype=torch.int32))

    @staticmethod
    def from_dense(dense: torch.Tensor) -> Int8Rows:
        return Int8Rows.from_experts(tuple(dense.shape), lambda e: dense[e])

    @staticmethod
    def from_blocks(weights: ExpertWeights, shape: tuple[int, int, int]) -> Int8Rows:
        """From the bytes a MoEKernel computes on (GGML blocks, or bf16/f32), dequantized per expert."""
        return Int8Rows.from_experts(shape, _expert_source(weights, shape, "Int8Rows.from_blocks"))

    def dequantized(self) -> torch.Tensor:
        return self.rows().float() * self.scale[..., None]

    def addresses(self, shape: tuple[int, int, int]) -> tuple[int, int, int, int]:
        for t in (self.w, self.amx):
            if t is not None and (t.numel() != math.prod(shape) or t.dtype != torch.int8 or not t.is_contiguous()):
                raise ValueError(f"int8 weights must be a contiguous int8 tensor {shape}, got {tuple(t.shape)} {t.dtype}")
        if self.shape != tuple(shape):
            raise ValueError(f"int8 weights must be {shape}, got {self.shape}")
        if tuple(self.scale.shape) != shape[:2] or tuple(self.row_sum.shape) != shape[:2]:
            raise ValueError(f"int8 scales and row sums must be {shape[:2]}")
        return tuple(0 if t is None else t.data_ptr() for t in (self.w, self.scale, self.row_sum, self.amx))


def _expert_source(weights: ExpertWeights, shape: tuple[int, int, int], what: str):
    """expert(e) -> [rows, cols] float weights of expert e, dequantized from the bytes a MoEKernel
    computes on (GGML blocks, or bf16/f32 rows)."""
    from ..weights.ggml_quants import dequantize
    if weights.tiled:
        raise ValueError(f"{what} needs the GGUF's rows, not tiled weights")
    data = weights.data
    flat = data.reshape(-1).view(torch.uint8) if isinstance(data, torch.Tensor) else np.asarray(data).reshape(-1)
    per_expert = flat.shape[0] // shape[0]
    ext = load_extension()
    if int(weights.ggml_type) in ACTIVATION_BLOCK:  # the C++ decoders (the backward's), much faster than torch ops
        def decoded(e: int) -> torch.Tensor:
            raw = flat[e * per_expert:(e + 1) * per_expert]
            src, nbytes = _address(raw if isinstance(raw, torch.Tensor) else np.ascontiguousarray(raw))
            out = torch.empty(shape[1] * shape[2], dtype=torch.float32)
            ext.dequantize(int(weights.ggml_type), src, nbytes, out.numel(), out.data_ptr())
            return out.reshape(shape[1:])
        return decoded
    return lambda e: dequantize(flat[e * per_expert:(e + 1) * per_expert], weights.ggml_type, shape[1:])


# Steps tried for each group, as fractions of the one that maps its largest magnitude to -8: the
# group keeps the one with the least squared error (clipping a few outliers buys a finer grid for
# the rest, so on bell-shaped weights the error falls below the plain maximum's).
INT4_STEP_FRACTIONS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _int4_steps(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(step [..., 1], w in [-8, 7] [..., group]) for groups d [..., group] of float weights."""
    peak = torch.gather(d, -1, d.abs().argmax(dim=-1, keepdim=True)) / -8.0  # the signed largest magnitude -> -8
    best_err, best_step, best_w = None, None, None
    for f in INT4_STEP_FRACTIONS:
        step = peak * f
        w = torch.clamp(torch.round(d / torch.where(step != 0, step, torch.ones_like(step))), -8, 7)
        err = ((w * step - d) ** 2).sum(dim=-1, keepdim=True)
        if best_err is None:
            best_err, best_step, best_w = err, step, w
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_step, best_w = torch.where(better, step, best_step), torch.where(better, w, best_w)
    return best_step, best_w


@dataclass(frozen=True)
class Int4Rows:
    """A projection of all experts re-quantized for the int4 GEMM (csrc/int8.h): symmetric int4 in
    groups of `group` values along each row (each group's step by _int4_steps), two a byte in
    16-row x 64-column VNNI tiles; each row's and group's step; each row's
    correction for the activations' u8 offset (128 x sum over groups of step x the group's sum)."""
    q: torch.Tensor  # uint8 [E, rows/16, cols/64, 512]
    scale: torch.Tensor  # float32 [E, rows/16, cols/group, 16]
    corr: torch.Tensor  # float32 [E, rows]
    group: int

    @staticmethod
    def from_experts(shape: tuple[int, int, int], expert, group: int = 128) -> Int4Rows:
        """From E experts' float weights, `expert(e)` -> [rows, cols], one expert at a time."""
        E, rows, cols = shape
        if group % 64 or group <= 0 or cols % group or rows % 16:
            raise ValueError(f"int4 weights [{E}, {rows}, {cols}] in groups of {group}: need rows % 16 == 0 and "
                             f"the group a multiple of 64 dividing {cols}")
        q = weight_empty((E, rows // 16, cols // 64, 512))
        scale = torch.empty(E, rows // 16, cols // group, 16, dtype=torch.float32)
        corr = torch.empty(E, rows, dtype=torch.float32)
        for e in range(E):
            d = expert(e).float().reshape(rows, cols // group, group)
            step, w = _int4_steps(d)
            scale[e] = step.reshape(rows // 16, 16, cols // group).transpose(1, 2)
            corr[e] = 128.0 * (step[..., 0] * w.sum(dim=2)).sum(dim=1)
            u = (w + 8).to(torch.uint8).reshape(rows // 16, 16, cols // 64, 16, 4).permute(0, 2, 3, 1, 4)
            u = u.reshape(rows // 16, cols // 64, 1024)  # each block's int8 VNNI tile: [kk][n][4]
            q[e] = u[..., :512] | (u[..., 512:] << 4)
        return Int4Rows(q, scale, corr, group)

    @staticmethod
    def from_dense(dense: torch.Tensor, group: int = 128) -> Int4Rows:
        return Int4Rows.from_experts(tuple(dense.shape), lambda e: dense[e], group)

    @staticmethod
    def from_blocks(weights: ExpertWeights, shape: tuple[int, int, int], group: int = 128) -> Int4Rows:
        """From the bytes a MoEKernel computes on (GGML blocks, or bf16/f32), dequantized per expert."""
        return Int4Rows.from_experts(shape, _expert_source(weights, shape, "Int4Rows.from_blocks"), group)

    def dequantized(self) -> torch.Tensor:
        """[E, rows, cols] float32, read back from the packed layout."""
        E, blocks, chunks, _ = self.q.shape
        u = torch.cat([self.q & 15, self.q >> 4], dim=-1).reshape(E, blocks, chunks, 16, 16, 4)
        w = u.permute(0, 1, 4, 2, 3, 5).reshape(E, blocks * 16, chunks * 64).float() - 8.0
        step = self.scale.transpose(2, 3).reshape(E, blocks * 16, -1)
        return w * step.repeat_interleave(self.group, dim=2)

    def addresses(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        E, rows, cols = shape
        want = {"q": (E, rows // 16, cols // 64, 512), "scale": (E, rows // 16, cols // self.group, 16), "corr": (E, rows)}
        for name, dims in want.items():
            t = getattr(self, name)
            if rows % 16 or cols % self.group or tuple(t.shape) != dims or not t.is_contiguous() or \
                    t.dtype != (torch.uint8 if name == "q" else torch.float32):
                raise ValueError(f"int4 {name} for weights {shape} in groups of {self.group} must be a contiguous "
                                 f"{'uint8' if name == 'q' else 'float32'} tensor {dims}, got {tuple(t.shape)} {t.dtype}")
        return self.q.data_ptr(), self.scale.data_ptr(), self.corr.data_ptr()


def _int8_copy(runtime: CPURuntime, weights: ExpertWeights, shape: tuple[int, int, int], transpose: bool) -> Int8Rows:
    """Int8Rows of the E stored matrices [E, rows, cols] (their transposes with `transpose`), made
    on the pool by the C++ decoders (the GGUF's rows, not tiles)."""
    E, rows, cols = shape
    src, nbytes = _address(weights.data)
    out_rows, out_cols = (cols, rows) if transpose else (rows, cols)
    w = weight_empty((E, out_rows, out_cols), torch.int8)
    scale, row_sum = torch.empty(E, out_rows, dtype=torch.float32), torch.empty(E, out_rows, dtype=torch.int32)
    runtime.ext.int8_copies(runtime._rt, int(weights.ggml_type), src, nbytes, E, rows, cols, transpose, w.data_ptr(),
                            scale.data_ptr(), row_sum.data_ptr())
    return Int8Rows(w, scale, row_sum)


def dequantize_cpu(runtime: CPURuntime, raw, ggml_type: int, values: int) -> torch.Tensor:
    """float32 [values] of the GGML blocks in `raw` (the C++ decoders the experts' backward reads
    its weights through)."""
    src, nbytes = _address(raw)
    out = torch.empty(values, dtype=torch.float32)
    runtime.ext.dequantize(int(ggml_type), src, nbytes, values, out.data_ptr())
    return out


def round_activations_rows(x: torch.Tensor) -> torch.Tensor:
    """How the int8 prefill path rounds activations: int8 steps of amax/127 per whole row."""
    return round_activations(x, x.shape[-1])


def _check_activations(op: str, x: torch.Tensor, width: int) -> None:
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{op}: x must be a CPU tensor [T, {width}], got {tuple(x.shape)} on {x.device}")
    if x.dtype not in _DTYPE_CODE:
        raise ValueError(f"{op}: x must be float32 or bfloat16, got {x.dtype}")


def _expert_biases(name: str, biases, experts: int, hidden: int, intermediate: int) -> tuple[torch.Tensor, ...]:
    """(gate, up, down) biases as contiguous float32 CPU tensors of [E, I], [E, I], [E, H] (checked),
    or () without them."""
    if biases is None:
        return ()
    shapes = ((experts, intermediate), (experts, intermediate), (experts, hidden))
    if len(biases) != 3:
        raise ValueError(f"{name}: biases are (gate, up, down), got {len(biases)} tensors")
    out = []
    for which, b, shape in zip(("gate", "up", "down"), biases, shapes):
        if tuple(b.shape) != shape:
            raise ValueError(f"{name}: the {which} bias must be {list(shape)}, got {list(b.shape)}")
        out.append(b.detach().to("cpu", torch.float32).contiguous())
    return tuple(out)


def _copies_only(runtime: CPURuntime, name: str, weights, int8, int4) -> bool:
    """Whether the int8/int4 copies are the experts' only weights (gate, up and down all None),
    checked: one kind of copies at most, all three projections or none, a GEMM for copies alone."""
    if int8 is not None and int4 is not None:  # (before any repacking)
        raise ValueError(f"{name}: int8 and int4 prefill copies are alternatives; pass one")
    if all(w is None for w in weights):
        if int8 is None and int4 is None:
            raise ValueError(f"{name}: no weights: pass gate, up and down, or int8/int4 copies")
        if int4 is not None and not runtime.ext.int4_gemm:
            raise ValueError(f"{name}: the {runtime.isa} CPU kernels have no int4 GEMM (it needs AVX512-VNNI) "
                             "to compute on int4 copies alone")
        return True
    if any(w is None for w in weights):
        raise ValueError(f"{name}: pass all of gate, up and down, or none of them")
    return False


class MoEKernel:
    """Routed experts on the CPU, computed on the GGML blocks directly."""

    def __init__(self, runtime: CPURuntime, *, experts: int, top_k: int, hidden: int, intermediate: int,
                 gate: ExpertWeights | None, up: ExpertWeights | None, down: ExpertWeights | None,
                 max_tokens: int = 512, name: str = "MoE",
                 int8: tuple[Int8Rows, Int8Rows, Int8Rows] | None = None, int8_min_tokens: int = 4, tiles: bool = True,
                 int4: tuple[Int4Rows, Int4Rows, Int4Rows] | None = None,
                 biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.0):
        """`biases`: gate, up and down biases ([E, I], [E, I], [E, H]); `swiglu_limit`: gpt-oss's
        clamped SwiGLU with that limit and `swiglu_alpha` instead of silu(g) * u.
        `int8` (or `int4`, not both): re-quantized copies of gate, up, down for the int8 prefill
        GEMM (AVX512-VNNI builds; AMX tiles where the CPU has them); experts with at least
        `int8_min_tokens` tokens in a call use them. `tiles`: repack the projections this build
        has 16-row tiles for (tile_weights) at construction. gate, up and down all None: the
        copies are the experts' only weights, for every call (decode too)."""
        self.runtime, self.name = runtime, name
        self.experts, self.top_k, self.hidden = experts, top_k, hidden
        self.copies_only = _copies_only(runtime, name, (gate, up, down), int8, int4)
        if self.copies_only:
            int8_min_tokens = 1
        stored = None if self.copies_only or any(w.tiled for w in (gate, up, down)) else (gate, up, down)
        if tiles and not self.copies_only:
            if intermediate % 16 == 0:  # (16-row groups may not straddle two experts)
                gate = tile_weights(runtime, gate, experts * intermediate, hidden)
                up = tile_weights(runtime, up, experts * intermediate, hidden)
            if hidden % 16 == 0:
                down = tile_weights(runtime, down, experts * hidden, intermediate)
        _check_tilings(name, (gate, up, down), experts, hidden, intermediate)
        self._weights = (gate, up, down)  # keep the bytes alive as long as the kernel
        self.intermediate, self.max_tokens = intermediate, max_tokens
        self._grad, self._stored = None, stored  # the backward's kernel (made at its first call), the GGUF's rows
        # set before the first backward: int8_backward, its products on int8 copies (D^T, G^T, U^T), not the
        # blocks decoded; adapters: LoRA here (pair_*; int8: gate, up and down copies where the forward has none)
        self.int8_backward = self.adapters = False
        (g, gb), (u, ub), (d, db) = ((0, 0) if w is None else _address(w.data) for w in self._weights)
        addresses, addresses4, group, min_tokens = (), (), 0, 0
        shapes = ((experts, intermediate, hidden), (experts, intermediate, hidden), (experts, hidden, intermediate))
        if int8 is not None:  # (every level has the int8 GEMM)
            if runtime.ext.amx_available():
                int8 = tuple(rows.pack_amx() for rows in int8)
            addresses = tuple(a for rows, shape in zip(int8, shapes) for a in rows.addresses(shape))
            self._int8, min_tokens = int8, max(1, int8_min_tokens)  # (keeps the int8 and AMX copies alive)
        if int4 is not None and runtime.ext.int4_gemm:
            addresses4 = tuple(a for rows, shape in zip(int4, shapes) for a in rows.addresses(shape))
            self._int4, group, min_tokens = int4, int4[0].group, max(1, int8_min_tokens)
        self.int8_min_tokens = min_tokens
        # what a call reads of one expert it routes to (decode: the stored rows or tiles, else the copies)
        self.expert_bytes = (gb + ub + db) // experts if not self.copies_only else \
            sum(_copy_bytes(rows) for rows in (int8 if int8 is not None else int4)) // experts
        self._biases = _expert_biases(name, biases, experts, hidden, intermediate)
        limit = float(swiglu_limit or 0.0)
        if not (math.isfinite(limit) and limit >= 0 and math.isfinite(swiglu_alpha)):
            raise ValueError(f"{name}: swiglu_limit must be finite and positive (None: plain SwiGLU), swiglu_alpha "
                             f"finite; got {swiglu_limit}, {swiglu_alpha}")
        self.deferral = 0  # set_deferral's
        self._moe_limit, self._moe_alpha = limit, float(swiglu_alpha)
        self._moe = runtime.ext.MoE(runtime._rt, experts, top_k, hidden, intermediate, max_tokens,
                                    *(-1 if w is None else w.kernel_type(runtime.ext) for w in self._weights),
                                    g, gb, u, ub, d, db,
                                    addresses, min_tokens, addresses4, group, BF16_KERNELS.index(runtime.bf16_kernel),
                                    tuple(b.data_ptr() for b in self._biases), limit, float(swiglu_alpha))

    @property
    def experts_read(self) -> int:
        """Experts whose weights the calls have read since construction, an expert once a call
        however many of its tokens it serves: times expert_bytes, the bytes the calls streamed."""
        return self._moe.experts_read

    def _args(self, x, ids, weights):
        _check_activations(self.name, x, self.hidden)
        if ids.shape != (x.shape[0], self.top_k) or weights.shape != ids.shape:
            raise ValueError(f"{self.name}: top_k_index and top_k_weights must be [{x.shape[0]}, {self.top_k}], "
                             f"got {tuple(ids.shape)} and {tuple(weights.shape)}")
        if ids.dtype.is_floating_point:
            raise ValueError(f"{self.name}: top_k_index must be an integer tensor, got {ids.dtype}")
        # (converted only where needed: a decode call is short enough for each torch call to
        # count, the more with the caches cold after a call has streamed its weights through them)
        if not x.is_contiguous():
            x = x.contiguous()
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()  # ids outside [0, E): the C++ side raises ValueError first
        if weights.dtype != torch.float32 or not weights.is_contiguous():
            weights = weights.to(torch.float32).contiguous()
        return x, ids, weights, torch.empty_like(x)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, ids, weights, y = self._args(x, ids, weights)
        self._moe.forward(x.shape[0], ids.data_ptr(), weights.data_ptr(), x.data_ptr(), y.data_ptr(), _DTYPE_CODE[x.dtype])
        return y

    def forward_keeping(self, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, gate_up): forward, and each (token, slot) pair's g and u [T*K, 2I] float32 (biases
        added, before the activation; zeros for a slot of id -1), which backward then takes
        instead of recomputing them: a training step's forward."""
        x, ids, weights, y = self._args(x, ids, weights)
        gate_up = torch.empty(x.shape[0] * self.top_k, 2 * self.intermediate)
        self._moe.forward_keeping(x.shape[0], ids.data_ptr(), weights.data_ptr(), x.data_ptr(), y.data_ptr(),
                                  _DTYPE_CODE[x.dtype], gate_up.data_ptr())
        return y, gate_up

    def backward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dy: torch.Tensor,
                 gate_up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients (dx [T, H], dw [T, K], float32) of a forward call on (x, ids, weights)
        whose output's gradient is dy, the experts frozen (the C++ MoEGrad: the stored rows, as
        the GGUF holds them, decoded in place, or its int8 copies). g and u are forward_keeping's
        `gate_up` where given, else recomputed from x."""
        x, ids, weights, _ = self._args(x.float(), ids, weights)
        if dy.shape != x.shape:
            raise ValueError(f"{self.name}: dy must be [{x.shape[0]}, {self.hidden}] like x, got {tuple(dy.shape)}")
        if gate_up is not None:
            want = (x.shape[0] * self.top_k, 2 * self.intermediate)
            if tuple(gate_up.shape) != want or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu":
                raise ValueError(f"{self.name}: gate_up must be float32 {list(want)} on the CPU (forward_keeping's), got "
                                 f"{gate_up.dtype} {list(gate_up.shape)} on {gate_up.device}")
            gate_up = gate_up.contiguous()
        dy = dy.to("cpu", torch.float32).contiguous()
        dx, dw = torch.empty_like(x), torch.empty_like(weights)
        self._grad_kernel().backward(x.shape[0], ids.data_ptr(), weights.data_ptr(), x.data_ptr(), dy.data_ptr(),
                                     dx.data_ptr(), dw.data_ptr(), 0 if gate_up is None else gate_up.data_ptr())
        return dx, dw

    # (MoEGrad.pairs' ops)
    _GATE_UP, _DOWN, _DOWN_T, _GATE_UP_T = range(4)

    def _pairs(self, op: int, ids: torch.Tensor, a: torch.Tensor, a_shape: tuple, out_shapes: tuple,
               b: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if ids.dim() != 2 or ids.shape[1] != self.top_k or ids.dtype.is_floating_point:
            raise ValueError(f"{self.name}: top_k_index must be an integer tensor [T, {self.top_k}], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        ids = ids.to("cpu", torch.int64).contiguous()
        args = []
        for t in (a, b) if b is not None else (a,):
            if tuple(t.shape) != a_shape:
                raise ValueError(f"{self.name}: expected an input of shape {list(a_shape)}, got {list(t.shape)}")
            args.append(t.detach().to("cpu", torch.float32).contiguous())
        outs = tuple(torch.empty(shape) for shape in out_shapes)
        self._grad_kernel().pairs(op, ids.shape[0], ids.data_ptr(), args[0].data_ptr(),
                                  args[1].data_ptr() if b is not None else 0, outs[0].data_ptr(),
                                  outs[1].data_ptr() if len(outs) > 1 else 0)
        return outs

    def pair_gate_up(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, u) [T*K, I] float32: each (token, slot) pair's G_e x and U_e x, without biases (a
        slot of id -1: zero rows); the stored rows as the backward reads them (or its int8 copies)."""
        T, K, I = ids.shape[0], self.top_k, self.intermediate
        return self._pairs(self._GATE_UP, ids, x, (T, self.hidden), ((T * K, I), (T * K, I)))

    def pair_down(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """o [T*K, H] float32: each pair's D_e h, h [T*K, I] (no bias)."""
        T, K = ids.shape[0], self.top_k
        return self._pairs(self._DOWN, ids, h, (T * K, self.intermediate), ((T * K, self.hidden),))[0]

    def pair_down_t(self, dout: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """dh [T*K, I] float32: each pair's D_e^T dout, dout [T*K, H]."""
        T, K = ids.shape[0], self.top_k
        return self._pairs(self._DOWN_T, ids, dout, (T * K, self.hidden), ((T * K, self.intermediate),))[0]

    def pair_gate_up_t(self, dg: torch.Tensor, du: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """dx [T, H] float32: over each token's pairs, the sum of G_e^T dg + U_e^T du (dg, du [T*K, I])."""
        T, K = ids.shape[0], self.top_k
        return self._pairs(self._GATE_UP_T, ids, dg, (T * K, self.intermediate), ((T, self.hidden),), b=du)[0]

    def _grad_kernel(self):
        if self._grad is None:
            stored = self._stored
            if stored is None:
                raise ValueError(f"{self.name}: the backward reads the experts' stored GGML rows, and this kernel "
                                 "keeps none (int4_decode copies only, or weights passed as tiles)")
            (g, gb), (u, ub), (d, db) = (_address(w.data) for w in stored)
            self._grad_int8 = self._backward_copies(stored) if self.int8_backward else ()
            addresses = tuple(a for rows, shape in self._grad_int8
                              for a in (rows.addresses(shape) if rows is not None else (0, 0, 0, 0)))
            self._grad = self.runtime.ext.MoEGrad(
                self.runtime._rt, self.experts, self.top_k, self.hidden, self.intermediate, self.max_tokens,
                *(w.ggml_type for w in stored), g, gb, u, ub, d, db,
                tuple(b.data_ptr() for b in self._biases), float(self._moe_limit), float(self._moe_alpha), addresses)
        return self._grad

    def _backward_copies(self, stored) -> tuple:
        """((copy, shape), ...) of gate, up, D^T, G^T and U^T as int8 rows for the backward's
        GEMMs, or () where the sizes do not fit that GEMM (a warning says so). Gate and up are the
        forward's own copies where it has them; else, with adapters (whose pairs' products
        recompute g and u) made here, and without, None: the training forward hands g and u over
        (forward_keeping), and a backward without them recomputes them from the stored blocks."""
        ext = self.runtime.ext
        E, H, I = self.experts, self.hidden, self.intermediate
        if H % 64 or I % 64:
            warnings.warn(f"{self.name}: int8 backward is off: its GEMM needs hidden ({H}) and intermediate ({I}) sizes "
                          "divisible by 64; the backward decodes the stored blocks", stacklevel=4)
            return ()
        gate, up, down = stored
        own = getattr(self, "_int8", None)
        forward = own[:2] if own is not None else \
            tuple(_int8_copy(self.runtime, w, (E, I, H), False) if self.adapters else None for w in (gate, up))
        copies = (*forward, _int8_copy(self.runtime, down, (E, H, I), True),
                  *(_int8_copy(self.runtime, w, (E, I, H), True) for w in (gate, up)))
        shapes = ((E, I, H), (E, I, H), (E, I, H), (E, H, I), (E, H, I))
        if self.adapters:  # (pair_down's D h; the forward's own copy where it has one)
            copies += (own[2] if own is not None else _int8_copy(self.runtime, down, (E, H, I), False),)
            shapes += ((E, H, I),)
        if ext.amx_available():
            copies = tuple(c and c.pack_amx() for c in copies)
        return tuple(zip(copies, shapes))

    def last_seconds(self) -> float:
        """How long the last call took inside the kernel (from its first phase to its output)."""
        return self._moe.last_ns * 1e-9

    def set_deferral(self, defer: int, next_kernel: MoEKernel | None) -> None:
        """Expert deferral: while deferring (set_deferring), each call leaves out every token's
        `defer` lowest-weight experts and adds them to `next_kernel`'s following call's output
        (the C++ MoE's set_deferral says how); 0: off."""
        if defer and (next_kernel is None or next_kernel.runtime is not self.runtime):
            raise ValueError(f"{self.name}: deferral needs the next layer's CPU experts, on the same runtime")
        self._moe.set_deferral(defer, next_kernel._moe if defer else None)
        self.deferral = defer

    def set_deferring(self, on: bool) -> None:
        self._moe.set_deferring(bool(on))

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Queue the job and return the output tensor, valid after runtime.sync()."""
        x, ids, weights, y = self._args(x, ids, weights)
        self.runtime.hold(x, ids, weights, y)
        self._moe.submit(x.shape[0], ids.data_ptr(), weights.data_ptr(), x.data_ptr(), y.data_ptr(), _DTYPE_CODE[x.dtype])
        return y


class LinearKernel:
    """y [T, O] = x [T, I] @ W^T with W [O, I] as raw GGML blocks."""

    def __init__(self, runtime: CPURuntime, *, in_features: int, out_features: int, weight: ExpertWeights,
                 max_tokens: int = 512, name: str = "Linear", tiles: bool = True):
        """`tiles`: repack W into this build's 16-row tiles where it has them (tile_weights)."""
        self.runtime, self.name = runtime, name
        self.in_features, self.out_features = in_features, out_features
        if tiles:
            weight = tile_weights(runtime, weight, out_features, in_features)
        weight.check_tiling(name, out_features, in_features)
        self._weight = weight
        address, nbytes = _address(weight.data)
        self._linear = runtime.ext.Linear(runtime._rt, in_features, out_features, weight.kernel_type(runtime.ext), address,
                                          nbytes, max_tokens, BF16_KERNELS.index(runtime.bf16_kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_activations(self.name, x, self.in_features)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        self._linear.forward(x.shape[0], x.data_ptr(), y.data_ptr(), _DTYPE_CODE[x.dtype])
        return y


def softmax_topk(ext, logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of float32 logits [T, E] on the calling thread: (weights [T, k] float32,
    the softmax probabilities of the k largest logits, renormalized over them with `renorm`; ids
    [T, k] int64, largest first). One call where torch runs four small ops a decode step; ValueError
    for a NaN logit or k outside 1..E."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" or logits.shape[1] == 0:
        raise ValueError(f"softmax_topk: need float32 CPU logits [T, E] with E > 0, got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"softmax_topk: k must be in 1..{logits.shape[1]} (the experts), got {k}")
    logits = logits.contiguous()
    weights = torch.empty(logits.shape[0], k, dtype=torch.float32)
    ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
    ext.softmax_topk(logits.data_ptr(), logits.shape[0], logits.shape[1], k, bool(renorm), weights.data_ptr(),
                     ids.data_ptr())
    return weights, ids


def rms_norm(ext, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows on the calling thread: one call where torch runs five small ops
    (what matters at decode, a handful of tokens). x [..., n], weight [n], both float32 on the CPU."""
    n = weight.numel()
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != n or n == 0
            or x.device.type != "cpu" or weight.device.type != "cpu"):
        raise ValueError(f"rms_norm: need float32 CPU x [..., n] and weight [n] with n > 0, got {x.dtype} "
                         f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be finite and >= 0, got {eps}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    ext.rms_norm(x.data_ptr(), weight.data_ptr(), float(eps), x.numel() // n, n, out.data_ptr())
    return out


def _check_gqa_caches(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(total slots, kv heads) of float32 contiguous caches [slots, kv_heads, d] matching q [heads, d]."""
    if q.dim() != 2 or k_cache.dim() != 3:
        raise ValueError(f"{op}: need q [heads, d] and caches [slots, kv_heads, d], got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    heads, d = q.shape
    total, kv_heads, dk = k_cache.shape
    if (q.dtype, k_cache.dtype, v_cache.dtype) != (torch.float32,) * 3 or v_cache.shape != k_cache.shape or dk != d:
        raise ValueError(f"{op}: need float32 q [heads, d] and caches [slots, kv_heads, d], got "
                         f"{q.dtype} {tuple(q.shape)}, {k_cache.dtype} {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if heads <= 0 or kv_heads <= 0 or d <= 0 or heads % kv_heads:
        raise ValueError(f"{op}: need heads a positive multiple of kv_heads and d > 0, got {heads} heads, "
                         f"{kv_heads} kv heads, d {d}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: caches must be contiguous")
    return total, kv_heads


def _sinks_ptr(op: str, sinks: torch.Tensor | None, heads: int) -> int:
    """The address of float32 sinks [heads], or 0 without them."""
    if sinks is None:
        return 0
    if sinks.shape != (heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
        raise ValueError(f"{op}: sinks must be contiguous float32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    return sinks.data_ptr()


def attend_gqa_decode(runtime: CPURuntime, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention read in place from the paged cache: q [heads, d], k_cache and
    v_cache [total_slots, kv_heads, d] (float32, CPU), slots [L] int64 (the sequence's history in
    order, or the part a sliding window sees) -> [heads, d]; `sinks` [heads]: each head's sink
    logit (gpt-oss). Slots outside the cache raise ValueError before any read."""
    heads, d = q.shape
    total, kv_heads = _check_gqa_caches("attend_gqa_decode", q, k_cache, v_cache)
    q, slots = q.contiguous(), slots.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    runtime._rt.attend_gqa_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), total, slots.data_ptr(),
                                  slots.numel(), heads, kv_heads, d, float(scale), out.data_ptr(),
                                  _sinks_ptr("attend_gqa_decode", sinks, heads))
    return out


def rope_write_attend_gqa(runtime: CPURuntime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_slot: int,
                          slots: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step of one sequence after its projections: q [heads, d], k/v [kv_heads, d] (not yet
    rotated), cos/sin [r] (rotate-half RoPE at this position over the first r <= d values of each
    head, r even: partial rotary where r < d); rotates q and k, stores k and v in `write_slot` of the
    float32 caches [total_slots, kv_heads, d], and attends over `slots` -> [heads, d]. Same checks
    as attend_gqa_decode, all before any write."""
    heads, d = q.shape
    total, kv_heads = _check_gqa_caches("rope_write_attend_gqa", q, k_cache, v_cache)
    r = cos.shape[0] if cos.dim() == 1 else -1
    if (k.shape != (kv_heads, d) or v.shape != (kv_heads, d) or not 0 < r <= d or r % 2 or cos.shape != (r,)
            or sin.shape != (r,)):
        raise ValueError(f"rope_write_attend_gqa: k/v must be [{kv_heads}, {d}] and cos/sin [r] (r even, at most {d}), "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if any(t.dtype != torch.float32 for t in (k, v, cos, sin)):
        raise ValueError("rope_write_attend_gqa: k, v, cos and sin must be float32")
    q, k, v = q.contiguous().clone(), k.contiguous().clone(), v.contiguous()
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    runtime._rt.rope_write_attend_gqa(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                      k_cache.data_ptr(), v_cache.data_ptr(), total, int(write_slot), slots.data_ptr(),
                                      slots.numel(), heads, kv_heads, d, float(scale), out.data_ptr(),
                                      _sinks_ptr("rope_write_attend_gqa", sinks, heads), r)
    return out


def _delta_shapes(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """(B, T, Hk, Hv, Dk, Dv) of the delta rule's q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{what}: q and k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"{what}: value heads ({Hv}) must be a multiple of key heads ({Hk})")
    return B, T, Hk, Hv, Dk, Dv


def _qkv(q, k, v) -> tuple:
    return tuple((name, t, tuple(t.shape), torch.float32) for name, t in (("q", q), ("k", k), ("v", v)))


def _check_tensors(what: str, specs) -> None:
    """Each (name, tensor, shape, dtype): that shape, that dtype, contiguous, on the CPU."""
    for name, t, shape, dtype in specs:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what}: {name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            short = str(dtype).removeprefix("torch.")
            raise ValueError(f"{what}: {name} must be a contiguous {short} CPU tensor, got {t.dtype} on "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def gated_delta_rule(runtime: CPURuntime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, l2norm: bool = True) -> torch.Tensor:
    """The gated delta rule of gated-DeltaNet layers over T tokens of B sequences, as transformers'
    torch_recurrent_gated_delta_rule with [B, T, ...] inputs: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv],
    g, beta [B, T, Hv] -> out [B, T, Hv, Dv]; `state` [B, Hv, Dk, Dv] is the recurrent state,
    updated in place (all float32 and contiguous; Hv a multiple of Hk)."""
    B, T, Hk, Hv, Dk, Dv = _delta_shapes("gated_delta_rule", q, k, v)
    _check_tensors("gated_delta_rule", (("g", g, (B, T, Hv), torch.float32), ("beta", beta, (B, T, Hv), torch.float32),
                                        ("state", state, (B, Hv, Dk, Dv), torch.float32)) + _qkv(q, k, v))
    out = torch.empty(B, T, Hv, Dv, dtype=torch.float32)
    runtime._rt.gated_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                 state.data_ptr(), out.data_ptr(), B, T, Hk, Hv, Dk, Dv, bool(l2norm))
    return out


def gated_delta_rule_rows(runtime: CPURuntime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, states: torch.Tensor, rows_in: torch.Tensor,
                          rows_out: torch.Tensor) -> torch.Tensor:
    """gated_delta_rule over rows of a state table `states` [R, Hv, Dk, Dv] (float32, contiguous):
    sequence b starts from row rows_in[b] (-1: zero states) and leaves its state in row
    rows_out[b] (int64 [B] each; the same row: in place). Returns out [B, T, Hv, Dv]."""
    B, T, Hk, Hv, Dk, Dv = _delta_shapes("gated_delta_rule_rows", q, k, v)
    rows = states.shape[0] if states.dim() == 4 else -1
    _check_tensors("gated_delta_rule_rows", (
        ("g", g, (B, T, Hv), torch.float32), ("beta", beta, (B, T, Hv), torch.float32),
        ("states", states, (rows, Hv, Dk, Dv), torch.float32), ("rows_in", rows_in, (B,), torch.int64),
        ("rows_out", rows_out, (B,), torch.int64)) + _qkv(q, k, v))
    out = torch.empty(B, T, Hv, Dv, dtype=torch.float32)
    runtime._rt.gated_delta_rule_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                      states.data_ptr(), states.shape[0], rows_in.data_ptr(), rows_out.data_ptr(),
                                      out.data_ptr(), B, T, Hk, Hv, Dk, Dv, True)
    return out


def gated_delta_decode(runtime: CPURuntime, projections: tuple[torch.Tensor, ...], conv: torch.Tensor,
                       conv_w: torch.Tensor, ssm: torch.Tensor, reads: torch.Tensor, writes: torch.Tensor,
                       neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float,
                       heads: tuple[int, int, int, int], tiled: bool) -> torch.Tensor:
    """One decode token of n sequences through a gated DeltaNet layer from its input projections'
    rows (the C++ gated_delta_decode: beta and g, the conv step, the L2-normed delta rule and the
    gated RMSNorm, the conv and delta states read from rows `reads` (-1: zeros) and written to
    rows `writes` of the tables conv [R, C, K-1] and ssm [R, Hv, Dk, Dv]); the same contract as
    kernels.triton.deltanet.gated_delta_decode. `projections`: Qwen3-Next's fused in_proj_qkvz
    [n, Hk (2 Dk + 2 r Dv)] and in_proj_ba [n, 2 Hv], or Qwen3.5's in_proj_qkv [n, C], in_proj_z
    [n, Hv Dv], in_proj_b and in_proj_a [n, Hv]; heads (Hk, Hv, Dk, Dv). Returns [n, Hv Dv]."""
    Hk, Hv, Dk, Dv = heads
    fused = len(projections) == 2
    if len(projections) not in (2, 4):
        raise ValueError(f"gated_delta_decode: projections are (qkvz, ba) or (qkv, z, b, a), got {len(projections)}")
    C = 2 * Hk * Dk + Hv * Dv
    n = projections[0].shape[0] if projections[0].dim() == 2 else -1
    K = conv_w.shape[1] if conv_w.dim() == 2 else -1
    R = ssm.shape[0] if ssm.dim() == 4 else -1
    names = ("in_proj_qkvz", "in_proj_ba") if fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    widths = (Hk * (2 * Dk + 2 * (Hv // max(Hk, 1)) * Dv), 2 * Hv) if fused else (C, Hv * Dv, Hv, Hv)
    _check_tensors("gated_delta_decode", (
        *((name, t, (n, w), torch.float32) for name, t, w in zip(names, projections, widths)),
        ("conv_w", conv_w, (C, K), torch.float32), ("conv", conv, (R, C, K - 1), torch.float32),
        ("ssm", ssm, (R, Hv, Dk, Dv), torch.float32), ("neg_a", neg_a, (Hv,), torch.float32),
        ("dt_bias", dt_bias, (Hv,), torch.float32), ("norm_w", norm_w, (Dv,), torch.float32),
        ("reads", reads, (n,), torch.int64), ("writes", writes, (n,), torch.int64)))
    out = torch.empty(n, Hv * Dv, dtype=torch.float32)
    qkv, z, b, a = projections if not fused else (projections[0], None, projections[1], None)
    runtime._rt.gated_delta_decode(n, Hk, Hv, Dk, Dv, K, tiled, fused, qkv.data_ptr(), 0 if z is None else z.data_ptr(),
                                   b.data_ptr(), 0 if a is None else a.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
                                   conv_w.data_ptr(), conv.data_ptr(), R, reads.data_ptr(), writes.data_ptr(),
                                   ssm.data_ptr(), reads.data_ptr(), writes.data_ptr(), norm_w.data_ptr(), float(eps),
                                   out.data_ptr())
    return out


def round_activations(x: torch.Tensor, block: int | str | None) -> torch.Tensor:
    """x with each block of `block` values rounded to int8 steps of amax/127 (float32 in and out),
    exactly as the kernels prepare activations; BF16_ACTIVATIONS rounds each value to the nearest
    bf16, None leaves x as it is."""
    if block is None:
        return x
    if block == BF16_ACTIVATIONS:
        return x.to(torch.bfloat16).to(x.dtype)
    blocks = x.float().reshape(-1, block)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)
