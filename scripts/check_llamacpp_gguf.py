"""By-hand check: GGUFs made by llama.cpp's own converter and quantizer load and agree.

Needs llama.cpp's sources (convert_hf_to_gguf.py + gguf-py, e.g. from the llama-cpp-python sdist)
and a Python with llama_cpp installed for the quantizer (see ../shared/PEERS.md):

    python scripts/check_llamacpp_gguf.py --llama-src DIR/vendor/llama.cpp --llama-python VENV/bin/python

For each family: build a tiny random model + a fresh byte-level BPE tokenizer, convert it with
convert_hf_to_gguf.py (--outtype f32 and bf16), quantize the f32 file with llama_model_quantize
(Q8_0, Q6_K, Q4_K_M, IQ4_XS), load every file through the shipped CPU rules and compare logits:
  - f32 against the original model (names, permutations, the kv_b split must be exact);
  - quantized files against transformers' own GGUF loader where it supports the architecture
    (an independent decoder and name map), else against the file's tensors dequantized by the
    gguf package's numpy code and put back in HF layout by the test helpers.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import (FAMILIES, RULES, gguf_numpy_pieces, reference_rules, reference_state_dict, tiny_model,  # noqa: E402
                  train_tokenizer)

from ktransformers import optimize_and_load_gguf  # noqa: E402
from ktransformers.loader import RULES_DIR, build_skeleton  # noqa: E402

QUANTS = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
          "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}
FAMILY_QUANTS = {"gpt_oss": {"MXFP4_MOE": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"}}  # what the published files are
HF_GGUF_ARCHS = {"qwen3_moe", "qwen2_moe"}  # transformers' GGUF loader handles these

CONVERT = r"""
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py"); sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"   # a fresh BPE: treat as qwen2's pre-tokenizer
def no_sentencepiece(self, *a, **k):  # our tokenizer is BPE: let the llama converter fall back to it
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
import runpy; runpy.run_path(sys.argv[0], run_name="__main__")
"""

QUANTIZE = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, ftype)
assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) == 0
"""


# config.json fields the converter reads that transformers no longer writes (MiniMax-M2's rotary_dim)
EXTRA_CONFIG = {"minimax_m2": lambda c: {"rotary_dim": int(c.head_dim * c.rope_parameters["partial_rotary_factor"])}}

# converter flags a family needs (the hybrids' converter expects multi-token-prediction layers
# unless told there are none)
CONVERT_ARGS = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe_text": ["--no-mtp"]}

# Added tokens the converter looks up by name for a family (past the trained vocabulary)
SPECIAL_TOKENS = {"glm4_moe": ["[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"]}


def make_tokenizer(out: Path, vocab: int, family: str) -> None:
    special = SPECIAL_TOKENS.get(family, [])
    tokenizer = train_tokenizer(vocab - len(special))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.save_pretrained(out)


def check_tokenizer(hf_dir: Path, gguf: Path) -> str:
    from transformers import AutoTokenizer
    from ktransformers.loader import load_tokenizer
    ours, theirs = load_tokenizer(None, gguf), AutoTokenizer.from_pretrained(hf_dir)
    if ours is None:
        return "transformers could not build one"
    text = "the quick brown fox, hello world!"
    same = ours(text)["input_ids"] == theirs(text)["input_ids"]
    return f"{'same' if same else 'DIFFERENT'} ids as the HF tokenizer for {text!r}"


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def ours(family, config, path, rules=None):
    model = build_skeleton(config, torch.float32)
    optimize_and_load_gguf(model, rules or RULES_DIR / RULES[family], path, config)
    return model


def check_family(family: str, work: Path, args) -> list[str]:
    model = tiny_model(family)
    hf_dir = work / family
    model.save_pretrained(hf_dir)
    if family in EXTRA_CONFIG:
        import json
        config_file = hf_dir / "config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | EXTRA_CONFIG[family](model.config)))
    make_tokenizer(hf_dir, model.config.vocab_size, family)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    expect = logits(model, ids)
    lines = []
    for outtype in ("f32", "bf16"):
        path = work / f"{family}-{outtype}.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, str(args.llama_src), str(hf_dir), "--outfile", str(path),
                        "--outtype", outtype, *CONVERT_ARGS.get(family, [])], check=True, capture_output=True)
        lines.append(f"{family:12} {outtype:7} vs original model: rel err {rel(logits(ours(family, model.config, path), ids), expect):.2e}")
    lines.append(f"{family:12} tokenizer from GGUF metadata: {check_tokenizer(hf_dir, work / f'{family}-f32.gguf')}")
    for name, ftype in ({} if args.no_quantize else QUANTS | FAMILY_QUANTS.get(family, {})).items():
        path = work / f"{family}-{name}.gguf"
        done = subprocess.run([args.llama_python, "-c", QUANTIZE, str(work / f"{family}-f32.gguf"), str(path), ftype],
                              capture_output=True, text=True)
        if done.returncode:
            why = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no message"]
            lines.append(f"{family:12} {name:7} llama.cpp's quantizer refused the file: {why[0][:160]}")
            continue
        got = logits(ours(family, model.config, path), ids)
        if family in HF_GGUF_ARCHS:
            from transformers import AutoModelForCausalLM
            ref = AutoModelForCausalLM.from_pretrained(work, gguf_file=path.name, config=model.config,
                                                       dtype=torch.float32).eval()
            lines.append(f"{family:12} {name:7} vs transformers' GGUF loader: rel err {rel(got, logits(ref, ids)):.2e}")
        else:
            ref = tiny_model(family, seed=1)
            ref.load_state_dict(reference_state_dict(model, piece=gguf_numpy_pieces(path)))
            exact = logits(ours(family, model.config, path, reference_rules(family, work)), ids)
            lines.append(f"{family:12} {name:7} vs gguf-package dequant of the same file: rel err "
                         f"{rel(got, logits(ref, ids)):.2e}, {rel(exact, logits(ref, ids)):.2e} with the torch "
                         f"reference ops (vs original model: {rel(got, expect):.2e})")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-src", type=Path, required=True)
    p.add_argument("--llama-python", help="a Python with llama_cpp, for the quantized files")
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    p.add_argument("--no-quantize", action="store_true", help="only the converter's f32 and bf16 files (no llama_cpp needed)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for line in check_family(family, Path(tmp), args):
                print(line, flush=True)


if __name__ == "__main__":
    main()
