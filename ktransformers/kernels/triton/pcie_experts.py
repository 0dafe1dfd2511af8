"""A share of a decode token's routed experts computed by the GPU from the CPU's own copy of
their weights, read in place over PCIe while the CPU threads compute the rest.

Decoding on the CPU experts is bound by how fast the host's memory is read. The GPU can read
host memory too, over the bus, at a fraction of what the cores read. The two share one memory
system: with the GPU reading, the cores' rate falls below theirs alone, but together they read
more than the cores alone (operators/experts/placement.py weighs the two; it measures both
rates at load). So, of a token's top-k experts, the last `share` are computed here from the
CPU kernel's 16-row tiles (csrc/blocks.h: `tile_q4_k16`, `tile_q6_k16`; their buffers page-locked
with cudaHostRegister), and the CPU kernel skips them (their ids packed as -1). No byte is copied
and no second copy of the weights is kept.

Two launches: gate and up of every (token, expert) pair as float32 rows, then down of
silu(gate) * up times each pair's routing weight, summed over the token's pairs in one program
(no atomics: the same bits every run). Sums are float32 against float32 activations (the CPU
kernel quantizes its activations to int8 blocks), so the share agrees with the CPU's experts to
their rounding, not to the bit. The bytes cross the bus once; the arithmetic is far below it,
so the kernels need only enough loads in flight (one program per 16 rows of each matrix).

The torch reference is `moe_reference` on the dequantized weights (tests).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ...weights.ggml_quants import GGMLType
from .common import sm_count
from .dequant import _f16_at
from .norm_rope import round_to

# ggml type -> bytes of one 16-row tile of 256 values (16 blocks)
TILE_BYTES = {int(GGMLType.Q4_K): 16 * 144, int(GGMLType.Q6_K): 16 * 210}
TILE_ROWS, TILE_COLS = 16, 256
MAX_TOKENS = 8  # decode steps; more tokens leave all their experts to the CPU


@triton.jit
def _act(x_ptr, u_ptr, idx, ACT: tl.constexpr):
    """float32 activations at idx: x itself, or silu(x) * u (ACT: the down projection's input)."""
    v = tl.load(x_ptr + idx).to(tl.float32)
    if ACT:
        v = v * tl.sigmoid(v) * tl.load(u_ptr + idx)
    return v


@triton.jit
def _tile_dot(tile, x_ptr, u_ptr, TYPE: tl.constexpr, ACT: tl.constexpr):
    """float32 [16]: the 16 rows of one tile (256 values from the column x_ptr points at) dotted
    with the activations there. Byte offsets as csrc/blocks.h lays the tiles out."""
    r = tl.arange(0, 16)
    a = tl.arange(0, 32)[:, None]  # qs row 4j + q (Q6_K: its ql row of block j, nibble step q)
    c = tl.arange(0, 64)[None, :]  # lane byte 4r + i
    j = a // 4
    q = a % 4
    xi = 32 * j + 4 * q + c % 4  # the value a low nibble holds; +16 for the high one
    xlo = _act(x_ptr, u_ptr, xi, ACT)
    xhi = _act(x_ptr, u_ptr, xi + 16, ACT)
    if TYPE == 12:  # Q4_K: d[16] f16 | dmin[16] f16 | sc[3][16] u32 | qs[32][64]
        qs = tl.load(tile + 256 + a * 64 + c).to(tl.int32)
        part = tl.reshape((qs & 15).to(tl.float32) * xlo + (qs >> 4).to(tl.float32) * xhi, (8, 4, 16, 4))
        dots = tl.sum(tl.sum(part, axis=3), axis=1)  # [8 sub-blocks, 16 rows]
        jb = tl.arange(0, 8)[:, None]
        jl = jb % 4
        # byte t of row r's 12 packed scale bytes: sc[t // 4][r], byte t % 4
        lo = tl.load(tile + 64 + 4 * r[None, :] + jl).to(tl.int32)  # bytes 0-3
        mid = tl.load(tile + 128 + 4 * r[None, :] + jl).to(tl.int32)  # bytes 4-7
        hi = tl.load(tile + 192 + 4 * r[None, :] + jl).to(tl.int32)  # bytes 8-11
        first = jb < 4
        sc = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4)).to(tl.float32)
        mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4)).to(tl.float32)
        xs = tl.sum(_act(x_ptr, u_ptr, tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :], ACT), axis=1)
        d = _f16_at(tile + 2 * r, r < 16)
        dmin = _f16_at(tile + 32 + 2 * r, r < 16)
        return d * tl.sum(sc * dots, axis=0) - dmin * tl.sum(mn * xs[:, None], axis=0)
    else:  # Q6_K: part[4] {sc[2][16][2] i8 | half[2] {qh[2][64] | ql[4][64]}} | d[16] f16
        p = j // 2
        s = j % 2
        half = tile + 832 * p + 64 + 384 * s
        ql = tl.load(half + 128 + 64 * q + c).to(tl.int32)
        qh = tl.load(half + 64 * (q // 2) + c).to(tl.int32)
        shift = 4 * (q % 2)
        vlo = ((ql & 15) | (((qh >> shift) & 3) << 4)) - 32
        vhi = ((ql >> 4) | (((qh >> (shift + 2)) & 3) << 4)) - 32
        dlo = tl.sum(tl.sum(tl.reshape(vlo.to(tl.float32) * xlo, (8, 4, 16, 4)), axis=3), axis=1)
        dhi = tl.sum(tl.sum(tl.reshape(vhi.to(tl.float32) * xhi, (8, 4, 16, 4)), axis=3), axis=1)
        jb = tl.arange(0, 8)[:, None]
        sc_at = tile + 832 * (jb // 2) + 32 * (jb % 2) + 2 * r[None, :]
        sc0 = tl.load(sc_at).to(tl.int8, bitcast=True).to(tl.float32)
        sc1 = tl.load(sc_at + 1).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16_at(tile + 3328 + 2 * r, r < 16)
        return d * tl.sum(sc0 * dlo + sc1 * dhi, axis=0)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, gate_ptr, up_ptr, h_ptr, E, I, H, col0, share, stride_x, stride_ids,
                    GATE: tl.constexpr, UP: tl.constexpr, GATE_TILE: tl.constexpr, UP_TILE: tl.constexpr):
    """program (pair, 16-row group of I, gate|up): h[pair, which, rows] = W rows . x[token]."""
    pair = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)
    t = pair // share
    named = tl.load(ids_ptr + t * stride_ids + col0 + pair % share).to(tl.int64)
    ok = (named >= 0) & (named < E)
    e = tl.where(ok, named, 0)
    nb = H // 256
    x = x_ptr + t * stride_x
    rows = grp * 16 + tl.arange(0, 16)
    acc = tl.zeros((16,), dtype=tl.float32)
    if ok:  # (-1: a pair left out, nothing read; another bad id: nothing read, the output NaN)
        if tl.program_id(2) == 0:
            base = gate_ptr + (e * (I // 16) + grp) * nb * GATE_TILE
            for b in range(0, nb):
                acc += _tile_dot(base + b * GATE_TILE, x + b * 256, x, GATE, False)
        else:
            base = up_ptr + (e * (I // 16) + grp) * nb * UP_TILE
            for b in range(0, nb):
                acc += _tile_dot(base + b * UP_TILE, x + b * 256, x, UP, False)
    acc = tl.where(ok | (named == -1), acc, float("nan"))
    tl.store(h_ptr + (pair * 2 + tl.program_id(2)) * I + rows, acc)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, E, I, H, col0, share, stride_ids, stride_w,
                 DOWN: tl.constexpr, DOWN_TILE: tl.constexpr):
    """program (token, 16-row group of H): y[token, rows] = sum over the token's pairs of
    weight * down rows . (silu(gate) * up), in pair order."""
    t = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)
    nb = I // 256
    rows = grp * 16 + tl.arange(0, 16)
    y = tl.zeros((16,), dtype=tl.float32)
    for k in range(0, share):
        pair = t * share + k
        named = tl.load(ids_ptr + t * stride_ids + col0 + k).to(tl.int64)
        ok = (named >= 0) & (named < E)
        e = tl.where(ok, named, 0)
        wt = tl.load(w_ptr + t * stride_w + col0 + k).to(tl.float32)
        acc = tl.zeros((16,), dtype=tl.float32)
        if ok:
            base = down_ptr + (e * (H // 16) + grp) * nb * DOWN_TILE
            g = h_ptr + pair * 2 * I
            for b in range(0, nb):
                acc += _tile_dot(base + b * DOWN_TILE, g + b * 256, g + I + b * 256, DOWN, True)
        # -1: a pair computed elsewhere (hot experts on the GPU) adds nothing; another bad id: NaN
        y += tl.where(ok, wt * acc, tl.where(named == -1, 0.0, float("nan")))
    tl.store(y_ptr + t * H + rows, y)


def supports(types: tuple[int, int, int], tiled: tuple[bool, bool, bool], hidden: int, intermediate: int) -> str | None:
    """None when the share can run on these (gate, up, down) weights, else why not."""
    if not all(tiled):
        return "the CPU experts' weights are not in 16-row tiles"
    if any(t not in TILE_BYTES for t in types):
        names = ", ".join(GGMLType(t).name for t in types)
        return f"its kernels read Q4_K and Q6_K tiles, the experts are {names}"
    if hidden % TILE_COLS or intermediate % TILE_COLS:
        return f"hidden {hidden} and intermediate {intermediate} must be multiples of {TILE_COLS}"
    return None


def pcie_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, col0: int,
                 gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: tuple[int, int, int],
                 experts: int, intermediate: int) -> torch.Tensor:
    """float32 [T, H]: sum over k >= col0 of weights[t, k] * expert ids[t, k] (x[t]) (id -1: a pair
    left out; an id outside [-1, E): the token's row is NaN), the experts'
    (gate, up, down) read from tile buffers (uint8, `types` their ggml types) that the GPU can
    address (page-locked host memory or device memory). x [T, H] float rows, ids/weights [T, K]
    on x's device."""
    T, H = x.shape
    K = ids.shape[1]
    share = K - col0
    I = intermediate
    if not 0 < share <= K or T > MAX_TOKENS or tuple(ids.shape) != (T, K) or tuple(weights.shape) != (T, K):
        raise ValueError(f"pcie_experts: x [T<={MAX_TOKENS}, H], ids/weights [T, K] and 0 <= col0 < K, got "
                         f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}, col0 {col0}")
    if x.stride(1) != 1 or ids.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError("pcie_experts: x, ids and weights need contiguous rows")
    want = (experts * I * H // TILE_COLS * TILE_BYTES[types[0]] // TILE_ROWS,
            experts * I * H // TILE_COLS * TILE_BYTES[types[1]] // TILE_ROWS,
            experts * H * I // TILE_COLS * TILE_BYTES[types[2]] // TILE_ROWS)
    for name, buf, n in zip(("gate", "up", "down"), (gate, up, down), want):
        if buf.dtype != torch.uint8 or buf.numel() != n:
            raise ValueError(f"pcie_experts: {name} must be {n} bytes of tiles, got {buf.numel()} {buf.dtype}")
    h = torch.empty(T * share, 2, I, device=x.device, dtype=torch.float32)
    y = torch.empty(T, H, device=x.device, dtype=torch.float32)
    _gate_up_kernel[(T * share, I // TILE_ROWS, 2)](x, ids, gate, up, h, experts, I, H, col0, share, x.stride(0),
                                                    ids.stride(0), GATE=types[0], UP=types[1],
                                                    GATE_TILE=TILE_BYTES[types[0]], UP_TILE=TILE_BYTES[types[1]],
                                                    num_warps=4)
    _down_kernel[(T, H // TILE_ROWS)](h, ids, weights, down, y, experts, I, H, col0, share, ids.stride(0),
                                      weights.stride(0), DOWN=types[2], DOWN_TILE=TILE_BYTES[types[2]], num_warps=4)
    return y


def _clear_last_cuda_error() -> None:
    """cudaGetLastError() of the CUDA runtime this process loaded: a failed cudaHostRegister
    leaves its error as the runtime's last, which torch's next kernel-launch check would raise
    as its own. (Found by the runtime library's path in this process's mappings; nothing to do
    where there is none.)"""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class HostRegistration:
    """CPU tensors page-locked and mapped for every GPU (cudaHostRegister, portable) until
    close(): the CPU experts' tile buffers, which the share's kernels then read in place. The
    tensors are kept alive as long as they are registered."""

    PORTABLE = 1  # cudaHostRegisterPortable

    def __init__(self, tensors):
        self.tensors = []
        cudart = torch.cuda.cudart()
        try:
            for t in tensors:
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError("HostRegistration: contiguous CPU tensors only")
                err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), self.PORTABLE)
                if int(err) != 0:
                    _clear_last_cuda_error()
                    raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed "
                                       f"(cudaError {int(err)}: {cudart.cudaGetErrorString(err)})")
                self.tensors.append(t)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unregister (after the GPU's work so far: a share kernel may still read the tiles; CUDA
        graphs that read them must be dropped first)."""
        if self.tensors:
            torch.cuda.synchronize()
        cudart = torch.cuda.cudart() if self.tensors else None
        while self.tensors:
            cudart.cudaHostUnregister(self.tensors.pop().data_ptr())

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass


@triton.jit
def _read_kernel(src, out, n_words, per_program, BLOCK: tl.constexpr):
    """Every word of src read once (program p: its run of per_program words), their sum stored."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(pid * per_program, pid * per_program + per_program, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(src + idx, mask=idx < n_words, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def read_words(buf: torch.Tensor, out: torch.Tensor, programs: int = 1056, block: int = 1024) -> None:
    """One launch reading int32 `buf` (device or page-locked host memory) in place; `out`: an
    int32 device tensor of at least `programs` words."""
    n = buf.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    _read_kernel[(programs,)](buf, out, n, per, BLOCK=block, num_warps=4)


def bus_read_gbps(device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N rate (GB/s) of a kernel on `device` reading page-locked host memory in place:
    the bus's part of the decode roofline when pcie_experts is on (bench.e2e)."""
    host = torch.ones(nbytes // 4, dtype=torch.int32, pin_memory=True)
    out = torch.empty(1056, dtype=torch.int32, device=device)
    best = 0.0
    with torch.cuda.device(device):
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            read_words(host, out)
            end.record()
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


@triton.jit
def _dequant_tiles_kernel(tiles, out, n_tiles, row_groups, nb, s_oe, s_or,
                          TYPE: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr):
    """Program p: runs of TILES tiles in a row, from tile p * TILES on, every programs * TILES
    tiles (tile t: expert t // (row_groups * nb), its rows 16 (t // nb % row_groups) ..+16, columns
    256 (t % nb) ..+256) -> out[e, row, col] (row stride s_or, expert stride s_oe), each value with
    dequant.dequantize's float32 arithmetic, rounded to out's dtype.
    Element (a, c) of a tile's qs rows (a = 4j + q, lane byte c = 4r + i) holds values
    32j + 4q + i (low nibble) and +16 (high) of row r: Q4_K as d*sc*q - dmin*m, Q6_K as d*sc*(q-32)."""
    a = tl.arange(0, 32)[:, None]
    c = tl.arange(0, 64)[None, :]
    j = a // 4
    q = a % 4
    r = c // 4
    lo_col = 32 * j + 4 * q + c % 4  # [32, 64]: the column (in the block) of the low nibble's value
    for start in range(tl.program_id(0).to(tl.int64) * TILES, n_tiles, tl.num_programs(0) * TILES):  # (int64: offsets)
        for k in tl.static_range(TILES):
            t = start + k
            if t < n_tiles:
                tile = tiles + t * TILE
                e = t // (row_groups * nb)
                row = (t // nb) % row_groups * 16 + r
                dst = out + e * s_oe + row * s_or + (t % nb) * 256 + lo_col
                if TYPE == 12:  # Q4_K: d[16] f16 | dmin[16] f16 | sc[3][16] u32 | qs[32][64]
                    qs = tl.load(tile + 256 + a * 64 + c).to(tl.int32)
                    jl = j % 4
                    lo = tl.load(tile + 64 + 4 * r + jl).to(tl.int32)  # packed scale bytes 0-3 of row r
                    mid = tl.load(tile + 128 + 4 * r + jl).to(tl.int32)  # bytes 4-7
                    hi = tl.load(tile + 192 + 4 * r + jl).to(tl.int32)  # bytes 8-11
                    first = j < 4
                    sc = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4))
                    mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
                    d = _f16_at(tile + 2 * r, r < 16)
                    dmin = _f16_at(tile + 32 + 2 * r, r < 16)
                    scale = d * sc.to(tl.float32)
                    low = dmin * mn.to(tl.float32)
                    vlo = scale * (qs & 15).to(tl.float32) - low
                    vhi = scale * (qs >> 4).to(tl.float32) - low
                else:  # Q6_K: part[4] {sc[2][16][2] i8 | half[2] {qh[2][64] | ql[4][64]}} | d[16] f16
                    half = tile + 832 * (j // 2) + 64 + 384 * (j % 2)
                    ql = tl.load(half + 128 + 64 * q + c).to(tl.int32)
                    qh = tl.load(half + 64 * (q // 2) + c).to(tl.int32)
                    shift = 4 * (q % 2)
                    sc_at = tile + 832 * (j // 2) + 32 * (j % 2) + 2 * r
                    d = _f16_at(tile + 3328 + 2 * r, r < 16)
                    s0 = d * tl.load(sc_at).to(tl.int8, bitcast=True).to(tl.float32)  # sub-block 2j: the low half
                    s1 = d * tl.load(sc_at + 1).to(tl.int8, bitcast=True).to(tl.float32)  # 2j + 1: the high half
                    vlo = s0 * (((ql & 15) | (((qh >> shift) & 3) << 4)) - 32).to(tl.float32)
                    vhi = s1 * (((ql >> 4) | (((qh >> (shift + 2)) & 3) << 4)) - 32).to(tl.float32)
                ty = out.dtype.element_ty
                tl.store(dst, round_to(vlo, ty).to(ty))
                tl.store(dst + 16, round_to(vhi, ty).to(ty))


def dequantize_tiles(tiles: torch.Tensor, ggml_type: int, shape: tuple[int, int, int], out: torch.Tensor,
                     programs: int | None = None) -> torch.Tensor:
    """Experts [n, R, C] in the CPU kernel's 16-row tiles (uint8, where the GPU can read them:
    page-locked host memory is read in place over the bus) -> out [n, R, C] (bf16/f16/f32 on the
    GPU; rows of C contiguous, the rows and experts at any stride: gate into gate_up[:, :I]), the
    values dequant.dequantize gives for the same blocks as stored in the GGUF, to the bit.
    Layer-wise prefill's path when the experts are tiled: no copy to stage, one read of each byte.
    `programs`: at most this many programs, each taking every programs-th run of tiles (0: one
    program a run); by default one a streaming multiprocessor. Programs reading over the bus
    mostly wait: one a run of tiles (thousands for one projection) would fill the SMs that the
    MoE computing on the other stream needs."""
    n, R, C = (int(s) for s in shape)
    t = int(ggml_type)
    if t not in TILE_BYTES:
        raise ValueError(f"dequantize_tiles: tiles of Q4_K and Q6_K only, got ggml type {t}")
    if R % TILE_ROWS or C % TILE_COLS:
        raise ValueError(f"dequantize_tiles: rows {R} must be a multiple of {TILE_ROWS} and columns {C} of {TILE_COLS}")
    n_tiles = n * R // TILE_ROWS * (C // TILE_COLS)
    if tiles.dtype != torch.uint8 or not tiles.is_contiguous() or tiles.numel() != n_tiles * TILE_BYTES[t]:
        raise ValueError(f"dequantize_tiles: {n_tiles} tiles of {TILE_BYTES[t]} bytes expected, got "
                         f"{tiles.numel()} {tiles.dtype}")
    if tuple(out.shape) != (n, R, C) or out.stride(2) != 1 or out.dtype not in (torch.bfloat16, torch.float16,
                                                                               torch.float32):
        raise ValueError(f"dequantize_tiles: out must be a float [{n}, {R}, {C}] with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    TILES = 4
    runs = triton.cdiv(n_tiles, TILES)
    if programs is None:
        programs = sm_count(out.device)
    elif programs < 0:
        raise ValueError(f"dequantize_tiles: programs must be >= 0 (0: one a run of tiles), got {programs}")
    if n_tiles:
        grid = (min(runs, programs) if programs > 0 else runs,)
        _dequant_tiles_kernel[grid](tiles, out, n_tiles, R // TILE_ROWS, C // TILE_COLS, out.stride(0), out.stride(1),
                                    TYPE=t, TILE=TILE_BYTES[t], TILES=TILES, num_warps=4)
    return out
