"""Peak memory of loading a GGUF: is the file read into RAM only once?

    python -m ktransformers.bench.load --gguf /tmp/q3.gguf [--dtype bf16] [--json]

The file is memory-mapped, so its pages count in RSS once they are read; the loaded model is
the dequantized copy the rules asked for. A loader that also copied the file (read() into
bytes, or a numpy copy per tensor) would need a further file size on top: the table prints the
peak RSS growth against file + model bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

from ..loader import build_skeleton, default_rule_file, load_config
from ..optimize.inject import optimize_and_load_gguf
from ..weights.gguf import gguf_files

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_OF_TYPE = {"F16": "fp16", "BF16": "bf16", "F32": "fp32"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(gguf: str, dtype: torch.dtype = torch.bfloat16, rules: str | None = None) -> dict:
    config = load_config(None, gguf)
    model = build_skeleton(config, dtype)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    model_bytes = sum(sizes)
    file_bytes = sum(p.stat().st_size for p in gguf_files(gguf))
    _reset_peak()
    base = _rss_bytes()
    start = time.perf_counter()
    optimize_and_load_gguf(model, rules or default_rule_file(config), gguf, config)
    seconds = time.perf_counter() - start
    peak = _peak_bytes() - base
    return {"file_mib": file_bytes / 2**20, "model_mib": model_bytes / 2**20, "largest_tensor_mib": max(sizes) / 2**20,
            "peak_rss_growth_mib": peak / 2**20,
            "ratio_to_file_plus_model": peak / (file_bytes + model_bytes), "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--rules", help="rule file (default: the shipped CPU file for the architecture)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    a = p.parse_args(argv)
    row = measure(a.gguf, DTYPES[a.dtype], a.rules)
    if a.json:
        print(json.dumps(row))
        return
    print(f"{'file MiB':>10} {'model MiB':>10} {'peak RSS growth MiB':>20} {'growth/(file+model)':>20} {'load s':>8}")
    print(f"{row['file_mib']:>10.1f} {row['model_mib']:>10.1f} {row['peak_rss_growth_mib']:>20.1f} "
          f"{row['ratio_to_file_plus_model']:>20.2f} {row['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
