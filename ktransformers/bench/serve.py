"""The server under concurrent load: total output tok/s, time to first token and inter-token
latency at several concurrencies (streaming OpenAI chat requests of a fixed length).

    python -m ktransformers.bench.serve [--gguf_path M.gguf] [--concurrency 1 4 8 16] [--max_tokens 64]

Starts the server as its own process (`python -m ktransformers.server`, as deployed: the clients'
JSON parsing does not share its interpreter) on a free loopback port (the bundled demo model unless
--gguf_path), then for each concurrency C runs C clients, each sending --requests requests one
after another (`ignore_eos`, so every answer has --max_tokens tokens). Prints per C: total output
tok/s (all tokens / wall time) and its speed-up over the first C, the median stream's tok/s (its
tokens after the first / the time they took), median TTFT, the engine's mean prefill chunk (its
share of a TTFT; --json lists every request's TTFT), inter-token latency p50 and p99, and
the engine's own decode rate over the same level (decoded tokens / seconds in decode steps, from
the server's /health), which bounds what the clients can see: the gap is the server's overhead.
The engine's rate has a floor of its own: the expert weights its CPU experts streamed in those
decode steps (each step reads an expert once, however many streams route to it; from /health) at
the machine's streaming read rate (probed with --cpu_infer threads before the server starts and
after it stops, the higher), `floor tok/s`, and `ratio` = engine tok/s / floor tok/s. Batching
saves the GPU's per-step work and the experts several streams share; at random routing most of
a step's experts are distinct, so that floor, not the batch size, bounds the total.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(ttft seconds, gaps between content chunks, content chunks) of one streaming chat request."""
    import httpx
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    if not times:
        return float("nan"), [], 0
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def engine_stats(url: str) -> dict:
    import httpx
    return httpx.get(url + "/health", timeout=10).json()["engine"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; NaN for none."""
    if not values:
        return float("nan")
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q / 100 * len(ranked)) - 1))]


def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    def client(i: int):
        return [one_request(url, f"Request {i}.{k}: write about Python modules.", max_tokens) for k in range(requests)]
    before = engine_stats(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [r for rs in pool.map(client, range(concurrency)) for r in rs]
    wall = time.perf_counter() - t0
    after = engine_stats(url)
    tokens = concurrency * requests * max_tokens
    gaps = [g for _, gs, _ in results for g in gs]
    streams = [len(gs) / sum(gs) for _, gs, _ in results if gs and sum(gs) > 0]
    decoded = after["decode_tokens"] - before["decode_tokens"]
    expert_bytes = ((after["expert_bytes"] - after["prefill_expert_bytes"])
                    - (before["expert_bytes"] - before["prefill_expert_bytes"]))
    decode_s = after["decode_s"] - before["decode_s"]
    steps = after["decode_steps"] - before["decode_steps"]
    chunks = after["prefill_chunks"] - before["prefill_chunks"]
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "stream_tok_s": statistics.median(streams) if streams else float("nan"),
            "ttft_ms": statistics.median(r[0] for r in results) * 1e3, "ttfts_ms": [r[0] * 1e3 for r in results],
            "prefill_chunk_ms": (after["prefill_s"] - before["prefill_s"]) / chunks * 1e3 if chunks else float("nan"),
            "itl_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"), "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "engine_tok_s": decoded / decode_s if decode_s > 0 else float("nan"), "decode_tokens": decoded,
            "engine_batch": decoded / steps if steps else float("nan"), "decode_expert_bytes": expert_bytes}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path")
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--cpu_infer", type=int)
    p.add_argument("--cache_lens", type=int, default=8192)
    p.add_argument("--stream-gib", type=float, default=2.0, help="GiB read by the stream probe")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from ..kernels.cpu import CPURuntime
    from .moe import stream_gbps
    runtime = CPURuntime(args.cpu_infer or os.cpu_count())
    probes = [stream_gbps(runtime, args.stream_gib)]
    port = _free_port()
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url)
        one_request(url, "warm-up", 8)
        rows = [run_level(url, c, args.requests, args.max_tokens) for c in args.concurrency]
    finally:
        server.terminate()
        server.wait(timeout=30)
    probes.append(stream_gbps(runtime, args.stream_gib))
    stream = max(probes)
    for r in rows:
        seconds = r["decode_expert_bytes"] / (stream * 1e9)
        r["stream_gbps"] = stream
        r["floor_tok_s"] = r["decode_tokens"] / seconds if seconds > 0 else float("nan")
        r["ratio"] = r["engine_tok_s"] / r["floor_tok_s"]
    print_rows(rows, args.json)


def start_server(args, port: int) -> subprocess.Popen:
    """`python -m ktransformers.server` on `port`, batching as many sequences as the most clients."""
    cmd = [sys.executable, "-m", "ktransformers.server", "--port", str(port), "--cache_lens", str(args.cache_lens),
           "--max_batch_size", str(max(args.concurrency)), "--max_queue", str(4 * max(args.concurrency))]
    for key in ("gguf_path", "model_path", "optimize_config_path", "cpu_infer"):
        if getattr(args, key) is not None:
            cmd += [f"--{key}", str(getattr(args, key))]
    # stderr to a file, not a pipe: nobody reads a pipe while the server runs, and the load's progress
    # bars alone would fill it and stop the server mid-write
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    server.log = log
    return server


def server_log_tail(server: subprocess.Popen, chars: int = 2000) -> str:
    server.log.seek(0)
    return server.log.read()[-chars:]


def wait_until_healthy(server: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    """Until /health answers 200; SystemExit if the server exits or does not come up in time."""
    import httpx
    deadline = time.time() + timeout_s
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {server_log_tail(server)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            raise SystemExit(f"the server did not start in {timeout_s:.0f} s")
        time.sleep(0.2)


def print_rows(rows: list[dict], as_json: bool) -> None:
    """A table (or JSON lines) of the levels, each with its speed-up over the first level."""
    base = rows[0]["tok_s"]
    if not as_json:
        print(f"{'concurrency':>11} {'requests':>8} {'tok/s':>9} {'x C=' + str(rows[0]['concurrency']):>7} "
              f"{'stream tok/s':>12} {'TTFT ms':>9} {'chunk ms':>8} {'ITL p50':>8} {'ITL p99':>8} {'engine tok/s':>12} "
              f"{'batch':>6} {'floor tok/s':>11} {'ratio':>6}")
    for r in rows:
        r["speedup"] = r["tok_s"] / base
        if as_json:
            print(json.dumps(r))
        else:
            print(f"{r['concurrency']:>11} {r['requests']:>8} {r['tok_s']:>9.1f} {r['speedup']:>7.2f} "
                  f"{r['stream_tok_s']:>12.1f} {r['ttft_ms']:>9.1f} {r['prefill_chunk_ms']:>8.1f} {r['itl_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} "
                  f"{r['engine_tok_s']:>12.1f} {r['engine_batch']:>6.2f} {r['floor_tok_s']:>11.1f} {r['ratio']:>6.2f}")
    if not as_json and rows:
        print(f"(floor: the decode steps' expert bytes at the probed {rows[0]['stream_gbps']:.1f} GB/s)")


if __name__ == "__main__":
    main()
