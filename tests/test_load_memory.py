"""Loading a GGUF reads the file into RAM once: peak RSS growth stays near file + model bytes."""
import json
import subprocess
import sys

from ktransformers.bench.synth import preset_config, write_synthetic


def test_peak_rss_of_a_load(tmp_path):
    path = tmp_path / "syn.gguf"
    write_synthetic(preset_config("qwen3-30b-a3b", layers=1, experts=48, vocab=8000), path, "Q4_K_M")
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.load", "--gguf", str(path), "--json"],
                         check=True, capture_output=True, text=True).stdout
    row = json.loads(out)
    assert row["file_mib"] > 80
    # file pages (mmap) + the bf16 model + temporaries of one fused tensor; a second copy of the file would exceed it
    assert row["peak_rss_growth_mib"] < row["file_mib"] + row["model_mib"] * 1.35, row
