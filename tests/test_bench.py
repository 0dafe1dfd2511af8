"""The benchmarks run and print what they promise (numbers are not checked: speed is measured by
the benchmarks, not by tests)."""
import json
import subprocess
import sys

KEYS = {"shape", "format", "tokens", "threads", "isa", "median_us", "weight_bytes", "gbps", "stream_gbps", "tflops",
        "peer"}


def test_bench_moe_json_rows():
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.moe", "--shapes", "tiny", "--formats", "Q4_K_M",
                          "BF16", "--tokens", "1", "8", "--iters", "3", "--copies", "1", "--stream-gib", "0.05",
                          "--int8", "--no-peer", "--json"], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 4 and all(set(r) == KEYS for r in rows)
    assert [r["tokens"] for r in rows] == [1, 8, 1, 8]
    assert all(r["median_us"] > 0 and r["weight_bytes"] > 0 and r["stream_gbps"] > 0 and r["peer"] is None for r in rows)
    assert rows[0]["format"].startswith("Q4_K_M") and rows[2]["format"].startswith("BF16")
