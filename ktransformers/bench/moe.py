"""One MoE layer on the CPU kernels: time per call against the memory-bandwidth floor.

    python -m ktransformers.bench.moe [--shapes qwen3 deepseek] [--formats Q4_K_M Q8_0 BF16]
                                      [--tokens 1 4 32 128 512] [--threads N] [--json]

For each shape, format and token count T: median microseconds per call, the bytes of expert
weights the call must read (the experts its random routing touches), the effective GB/s and
TFLOP/s, the streaming read bandwidth of this machine measured in the same run (right before and
after each round of a row's calls, the higher of the two; a row of T <= 32 is the round, of
--rounds, with the median in-kernel ratio), and the ratio
of the two (1.0 = at the bandwidth floor). "median us" is a call from Python (the wrapper's checks
and the pybind11 crossing included, as kt-kernel's figure is); "kernel us" and "k.ratio" time the
same calls inside the kernel, which is what a decode step fed from a GPU stream pays (the
doorbell runs the kernel with no Python; --json: kernel_us, kernel_gbps). Weights are random valid GGML blocks; several copies
of the layer are cycled so that calls do not find their experts in the cache. When kt-kernel is
installed, the same layers, bytes and inputs run through it too, cycling the same copies (best
of 1 and N threads; its AMX classes, on bf16 copies, as many copies as RAM holds, said beside
its figure), and its median and our speedup over it are printed (`peer` in --json rows, with
`copies`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import psutil
import torch

from ..kernels.cpu import CPURuntime, ExpertWeights, Int4Rows, Int8Rows, MoEKernel
from ..weights.ggml_quants import FORMATS, GGMLType, dequantize, random_blocks
from ..weights.gguf_write import fit_type
from .peers import AMX_CLASSES, build_peers, kt_kernel_ext, quiet_stdout, time_peers

SHAPES = {"qwen3": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
          "deepseek": dict(hidden=7168, intermediate=2048, experts=256, top_k=8),
          "qwen3next": dict(hidden=2048, intermediate=512, experts=512, top_k=10),
          "glm": dict(hidden=4096, intermediate=1408, experts=128, top_k=8),  # GLM-4.5-Air
          "gptoss": dict(hidden=2880, intermediate=2880, experts=128, top_k=4),  # gpt-oss-120b
          "tiny": dict(hidden=256, intermediate=256, experts=8, top_k=2)}  # a smoke test of the benchmark itself
# format name -> (gate, up, down) ggml types; Q4_K_M is llama-quantize's mix for expert tensors. A
# type whose blocks do not divide a row falls back as llama-quantize's does (GLM's 1408-value down
# rows: Q6_K -> Q8_0)
FORMAT_TYPES = {"Q4_K_M": ("Q4_K", "Q4_K", "Q6_K"), **{n: (n, n, n) for n in
                ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "MXFP4", "BF16", "F16")}}


@dataclass
class Layer:
    kernel: MoEKernel
    expert_bytes: int  # bytes of one expert's three matrices
    weights: tuple  # the (gate, up, down) ExpertWeights, for the peer to read the same bytes


def _projection(t: GGMLType, experts: int, rows: int, cols: int, gen) -> ExpertWeights:
    blocks = experts * rows * cols // FORMATS[t].block_elems
    return ExpertWeights(random_blocks(t, blocks, gen).reshape(-1), int(t))


def build_layers(runtime, shape: dict, fmt: str, copies: int, experts: int, gen, int8: bool = False,
                 tiles: bool = True, int4: int = 0, int4_only: bool = False) -> list[Layer]:
    """`copies` of the layer in random blocks of `fmt`; with `int8` or `int4` (a group size), the
    prefill copies KExpertsCPU makes at load with int8_prefill / int4_prefill; `int4_only`: the
    int4 copies alone, as with int4_decode (the blocks kept only for the peer)."""
    H, I, K = shape["hidden"], shape["intermediate"], shape["top_k"]
    g, u, d = (fit_type(GGMLType[n], row) for n, row in zip(FORMAT_TYPES[fmt], (H, H, I)))
    layers = []
    for _ in range(copies):
        gate, up, down = _projection(g, experts, I, H, gen), _projection(u, experts, I, H, gen), _projection(d, experts, H, I, gen)
        per_expert = sum(w.data.numel() for w in (gate, up, down)) // experts
        rows8 = rows4 = None
        shapes = ((experts, I, H), (experts, I, H), (experts, H, I))
        if int8:
            rows8 = tuple(Int8Rows.from_blocks(w, s) for w, s in zip((gate, up, down), shapes))
        elif int4:
            rows4 = tuple(Int4Rows.from_blocks(w, s, int4) for w, s in zip((gate, up, down), shapes))
        if int4_only:
            per_expert = sum(r.q.numel() + 4 * (r.scale.numel() + r.corr.numel()) for r in rows4) // experts
            stored = (None, None, None)
        else:
            stored = (gate, up, down)
        layers.append(Layer(MoEKernel(runtime, experts=experts, top_k=K, hidden=H, intermediate=I, gate=stored[0],
                                      up=stored[1], down=stored[2], max_tokens=512, int8=rows8, int4=rows4, tiles=tiles),
                            per_expert, (gate, up, down)))
    return layers


_PROBE_BUFFERS: dict = {}  # size in bytes -> the probe's buffer, made once a process


def stream_gbps(runtime, gib: float = 2.0, repeats: int = 5) -> float:
    """Best-of-N streaming read bandwidth over a buffer much larger than the caches, the same
    buffer every probe of the process (a new one a probe, written and freed around every row's
    calls, can slow the calls right after it)."""
    size = int(gib * 2**30)
    if size not in _PROBE_BUFFERS:
        _PROBE_BUFFERS[size] = runtime.probe_buffer(gib)
    return runtime.stream_gbps(gib, repeats, buffer=_PROBE_BUFFERS[size])


def make_calls(n: int, T: int, experts: int, top_k: int, hidden: int, gen) -> list[tuple]:
    """n inputs with uniform random routing: (x bf16 [T, H], ids [T, K], weights [T, K])."""
    return [(torch.randn(T, hidden, generator=gen).to(torch.bfloat16),
             torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(T)]),
             torch.rand(T, top_k, generator=gen)) for _ in range(n)]


def time_layer(layers: list[Layer], calls: list[tuple]) -> tuple[float, float, int]:
    """(median seconds of a Python call, median seconds inside the kernel, mean bytes of weights
    touched) over the calls (two warm-up) cycling the layers. Inside the kernel is what a call fed
    from a GPU stream costs (the doorbell runs it with no Python); the Python call adds the
    wrapper's checks and the pybind11 crossing."""
    times, inside, touched = [], [], []
    for i, (x, ids, w) in enumerate(calls):
        layer = layers[i % len(layers)]
        start = time.perf_counter()
        layer.kernel.forward(x, ids, w)
        if i >= 2:
            times.append(time.perf_counter() - start)
            inside.append(layer.kernel.last_seconds())
            touched.append(len(torch.unique(ids)) * layer.expert_bytes)
    return statistics.median(times), statistics.median(inside), int(statistics.mean(touched))


def l3_bytes() -> int:
    """The largest cache of this machine's first CPU (sysfs; one CCX's or socket's L3 where the
    machine has several), 0 when unknown."""
    import glob
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale if text.rstrip("KMG").isdigit() else 0)
    return max(sizes, default=0)


def default_copies(shape: dict, fmt: str) -> int:
    """Copies of the layer to cycle: at least 3, and enough to hold 8x the last-level cache, so
    that calls read their experts from RAM as a model's layers do (a large L3 serves part of a
    few copies, which then read faster than the stream). Fewer where RAM is short (expert_budget
    then trims experts)."""
    layer = shape["experts"] * expert_bytes(shape, fmt)
    want = -(-8 * l3_bytes() // layer)
    fit = int(psutil.virtual_memory().available * 0.2 // layer)  # (a copy holds its blocks and its tiles)
    return max(3, min(want, fit, 64))


def expert_bytes(shape: dict, fmt: str) -> int:
    """Bytes of one expert's gate, up and down in the format's GGML blocks."""
    H, I = shape["hidden"], shape["intermediate"]
    return sum(I * H * FORMATS[GGMLType[n]].block_bytes // FORMATS[GGMLType[n]].block_elems for n in FORMAT_TYPES[fmt])


def expert_budget(shape: dict, fmt: str, copies: int, ram_fraction: float = 0.5, int8: bool = False,
                  int4: int = 0) -> int:
    """Experts per layer that fit in a fraction of available RAM (the full count when it fits)."""
    weights = 3 * shape["intermediate"] * shape["hidden"]
    copy = weights if int8 else weights * (0.5 + 4 / int4) if int4 else 0  # (int8: the rows, or their AMX tiles)
    per_expert = expert_bytes(shape, fmt) + copy
    fit = int(psutil.virtual_memory().available * ram_fraction / (per_expert * copies))
    return max(shape["top_k"], min(shape["experts"], fit))


def run(args) -> list[dict]:
    runtime = CPURuntime(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape_name in args.shapes:
        for fmt in args.formats:
            rows += run_format(args, runtime, SHAPES[shape_name], shape_name, fmt, gen)
    return rows


def run_format(args, runtime, shape: dict, shape_name: str, fmt: str, gen) -> list[dict]:
    """Ours for every T first, then kt-kernel on the same calls: its threads spin while it
    exists, so it must not live while ours is timed."""
    peer_threads = [] if args.no_peer or kt_kernel_ext() is None else (args.peer_threads or sorted({1, runtime.threads}))
    copies = args.copies or default_copies(shape, fmt)
    # (kt-kernel's layers point at our blocks; room for a copy of its own a thread count, should it copy them)
    experts = expert_budget(shape, fmt, copies + len(peer_threads), int8=args.int8, int4=args.int4)
    layers = build_layers(runtime, shape, fmt, copies, experts, gen, args.int8, not args.no_tiles, args.int4,
                          args.int4_only)
    label = fmt + ("" if not layers[0].kernel.int8_min_tokens else "+int8" if args.int8 else f"+int4g{args.int4}")
    if layers[0].kernel.copies_only:
        label = f"int4g{args.int4}"
    note = "" if experts == shape["experts"] else f" ({experts} of {shape['experts']} experts: RAM)"
    rows, all_calls = [], []
    for T in args.tokens:
        iters = args.iters if T <= 32 else max(3, args.iters // 4)
        calls = make_calls(iters + 2, T, experts, shape["top_k"], shape["hidden"], gen)
        flops = 2 * 3 * shape["hidden"] * shape["intermediate"] * T * shape["top_k"]
        measured = []
        for _ in range(args.rounds if T <= 32 else 1):  # (prefill rows: long calls, one round)
            # the probe right before and right after the round's calls, the higher of the two:
            # this machine's stream at the time of the round (a shared machine's moves by the
            # minute, so one probe at the start could miss a row's time by far)
            before = stream_gbps(runtime, args.stream_gib, 3)
            seconds, inside, nbytes = time_layer(layers, calls)
            stream = max(before, stream_gbps(runtime, args.stream_gib, 3))
            measured.append(dict(shape=shape_name + note, format=label, tokens=T, threads=runtime.threads,
                                 isa=runtime.isa,
                                 median_us=seconds * 1e6, kernel_us=inside * 1e6, weight_bytes=nbytes,
                                 gbps=nbytes / seconds / 1e9, kernel_gbps=nbytes / inside / 1e9,
                                 stream_gbps=stream, tflops=flops / seconds / 1e12, peer=None))
        # the row: the round of median in-kernel ratio (a round whose probes met the machine in
        # another phase than its calls moves the row no more than any other single round)
        measured.sort(key=lambda r: r["kernel_gbps"] / r["stream_gbps"])
        rows.append(measured[(len(measured) - 1) // 2])
        all_calls.append(calls)
    peers = build_peers(peer_threads, experts=experts, top_k=shape["top_k"], hidden=shape["hidden"],
                        intermediate=shape["intermediate"], types=FORMAT_TYPES[fmt],
                        copies=[tuple(w.data for w in layer.weights[:3]) for layer in layers])
    for row, calls in zip(rows, all_calls):
        row["peer"] = time_peers(peers, calls)
        print_row(row, args.json)
    with quiet_stdout():  # kt-kernel says goodbye on stdout
        del peers
    rows += amx_peer_rows(args, rows, all_calls, layers, peer_threads, experts, shape)
    with quiet_stdout():
        del layers
    return rows


def amx_peer_rows(args, rows: list[dict], all_calls: list, layers: list[Layer], peer_threads, experts: int,
                  shape: dict) -> list[dict]:
    """With --peer-amx: kt-kernel's AMX classes (which quantize bf16 weights themselves) on the
    same layer, dequantized, and the same calls; our figures repeated beside each, one row each."""
    if not args.peer_amx or not peer_threads:
        return []
    H, I, E = shape["hidden"], shape["intermediate"], experts
    # as many of our copies as RAM holds in bf16 (2 bytes a weight, with room for kt-kernel's own)
    dense_bytes = 3 * E * H * I * 2
    fit = max(1, int(psutil.virtual_memory().available * 0.3 // (dense_bytes * (1 + len(peer_threads)))))
    dense = [tuple(dequantize(w.data, w.ggml_type, s).to(torch.bfloat16).contiguous()
                   for w, s in zip(layer.weights, ((E, I, H), (E, I, H), (E, H, I)))) for layer in layers[:fit]]
    extra = []
    for klass in AMX_CLASSES:
        peers = build_peers(peer_threads, experts=E, top_k=shape["top_k"], hidden=H, intermediate=I,
                            types=("BF16",) * 3, copies=dense, klass=klass)
        for threads in peers:
            peers[threads].extra = True
        for row, calls in zip(rows, all_calls):
            extra.append(dict(row, peer=time_peers(peers, calls)))
            print_row(extra[-1], args.json)
        with quiet_stdout():  # its destructor greets on stdout too
            del peers
    return extra


HEADER = f"{'shape':<10} {'format':<7} {'T':>4} {'thr':>3} {'isa':<6} {'median us':>10} {'weight MB':>9} " \
         f"{'GB/s':>6} {'stream':>6} {'ratio':>5} {'kernel us':>9} {'k.ratio':>7} {'TFLOP/s':>7} " \
         f"{'kt-kernel us/thr':>12} {'speedup':>7}"


def print_row(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    print(f"{row['shape']:<10} {row['format']:<7} {row['tokens']:>4} {row['threads']:>3} {row['isa']:<6} "
          f"{row['median_us']:>10.1f} {row['weight_bytes'] / 1e6:>9.1f} {row['gbps']:>6.1f} {row['stream_gbps']:>6.1f} "
          f"{row['gbps'] / row['stream_gbps']:>5.2f} {row['kernel_us']:>9.1f} {row['kernel_gbps'] / row['stream_gbps']:>7.2f} "
          f"{row['tflops']:>7.3f}" + _peer_columns(row["peer"], row["median_us"]),
          flush=True)


def _peer_columns(peer: dict | None, ours_us: float) -> str:
    if peer is None:
        return f" {'-':>12} {'-':>7}"
    name, _, threads = peer["name"].rpartition(", ")  # "kt-kernel 0.7.2[ CLASS], N threads"
    label = name.split(" ", 2)[2] if name.count(" ") >= 2 else ""
    label += f" ({peer['copies']} copies)" if peer.get("copies", 1) > 1 else " (1 copy)"
    return f" {peer['median_us']:>9.1f}/{threads.split()[0]:<2} {peer['median_us'] / ours_us:>7.2f} {label}".rstrip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek"], choices=SHAPES)
    p.add_argument("--formats", nargs="+", default=["Q4_K_M", "Q8_0", "IQ4_XS", "BF16"], choices=FORMAT_TYPES)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 32, 128, 512])
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    p.add_argument("--copies", type=int, default=0,
                   help="copies of the layer cycled to defeat the caches (default: >= 3 and 8x the L3, RAM allowing)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (probe, calls, probe) a row of T <= 32 (the longer rows take one); "
                        "the row printed is the round of median in-kernel ratio")
    p.add_argument("--stream-gib", type=float, default=2.0, help="size of the bandwidth probe's buffer")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--int8", action="store_true",
                   help="also give our layers the int8 copies of the prefill path (experts with >= 4 tokens use them)")
    p.add_argument("--int4", type=int, nargs="?", const=128, default=0, metavar="GROUP",
                   help="or the int4 copies, in groups of GROUP columns (default 128)")
    p.add_argument("--int4-only", action="store_true",
                   help="with --int4: the int4 copies alone, for every call (as KExpertsCPU's int4_decode)")
    p.add_argument("--no-tiles", action="store_true",
                   help="compute on the GGUF's rows as stored (default: formats with 16-row tiles are repacked at load)")
    p.add_argument("--no-peer", action="store_true", help="do not run kt-kernel even when it is installed")
    p.add_argument("--peer-amx", action="store_true",
                   help="also time kt-kernel's AMX classes (int8, int4, bf16) on the layer's dequantized weights")
    p.add_argument("--peer-threads", type=int, nargs="+", help="kt-kernel thread counts to try (best is kept)")
    args = p.parse_args(argv)
    if args.int8 and args.int4:
        p.error("--int8 and --int4 are alternatives")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.int4_only and not args.int4:
        args.int4 = 128
    if not args.json:
        print(HEADER)
    run(args)


if __name__ == "__main__":
    main()
