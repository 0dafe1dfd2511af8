"""The bundled demo model: a 13M-parameter DeepSeek-V3-architecture MoE (MLA attention, one
shared expert, 16 routed experts with a sigmoid group-limited router, first layer dense) trained
on the English prose of the Python 3.11 documentation. Q8_0 GGUF with config and tokenizer in
its metadata; `hf/` holds the same config and tokenizer as an HF --model_path. A base LM: it
continues text. How it was made: docs/demo_model.md.

    from ktransformers import load_model
    from ktransformers.demo import DEMO_GGUF
    lm = load_model(DEMO_GGUF)  # config, tokenizer and weights from the one file; shipped CPU rules
"""
from pathlib import Path

DEMO_DIR = Path(__file__).parent
DEMO_GGUF = DEMO_DIR / "DeepSeek-V3-demo.gguf"
DEMO_HF_DIR = DEMO_DIR / "hf"  # config.json + tokenizer files
