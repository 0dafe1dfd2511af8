"""Loading a GGUF reads the file into RAM once: peak RSS growth stays near file + model bytes.

An F16 file loaded into an fp16 model makes the model as big as the file, so a loader that also
copied the file (read() into bytes, a numpy copy per tensor) would show a whole extra file."""
import json
import subprocess
import sys

from ktransformers.bench.synth import preset_config, write_synthetic


def test_peak_rss_of_a_load(tmp_path):
    path = tmp_path / "syn.gguf"
    write_synthetic(preset_config("qwen3-30b-a3b", layers=1, experts=16, vocab=8000), path, "F16")
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.load", "--gguf", str(path), "--dtype", "fp16",
                          "--json"], check=True, capture_output=True, text=True).stdout
    row = json.loads(out)
    assert row["file_mib"] > 150 and abs(row["model_mib"] / row["file_mib"] - 1) < 0.05
    # file pages (mmap) + the model + one part of the largest fused tensor, with 10% slack for the allocator
    bound = (row["file_mib"] + row["model_mib"]) * 1.1 + row["largest_tensor_mib"] / 2
    assert row["peak_rss_growth_mib"] < bound, row
