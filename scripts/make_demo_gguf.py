"""Write the bundled demo model: the checkpoint of scripts/train_demo.py as one GGUF (weights,
config and tokenizer in the metadata) into ktransformers/demo/, and its config.json + tokenizer
files into ktransformers/demo/hf/ (an HF --model_path for it).

    python scripts/make_demo_gguf.py --ckpt .demo_data/ckpt --corpus .demo_data/corpus.txt

Then checks the result: transformers rebuilds the same tokenizer from the GGUF metadata; the
GGUF loaded through ktransformers.load_model (the shipped CPU rule file, C++ kernels) gives
nearly the logits of transformers' own model on the fp32 checkpoint, and about its loss on the
held-out pages; and it prints greedy continuations of a few prompts.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo import (
    SAMPLE_PROMPTS,
    encode_pages,
    load_checkpoint,
    read_pages,
    split_pages,
)

from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import (
    converter_type,
    tokenizer_metadata,
    write_gguf,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "ktransformers" / "demo"
MAX_BYTES = 16 * 10**6
FILE_TYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def q4_k_m(name: str, shape: tuple[int, ...]) -> GGMLType:
    """llama-quantize's Q4_K_M, simplified: Q6_K for attn_v, ffn_down* and output; Q4_K elsewhere
    (Q8_0 where a row is not a whole number of 256-blocks)."""
    more_bits = "attn_v" in name or "ffn_down" in name or name == "output.weight"
    return converter_type(GGMLType.Q6_K if more_bits else GGMLType.Q4_K)(name, shape)


TYPES = {"Q8_0": converter_type(GGMLType.Q8_0), "Q6_K": converter_type(GGMLType.Q6_K), "Q4_K_M": q4_k_m,
         "F16": converter_type(GGMLType.F16)}


def write_demo(ckpt: Path, out: Path, type_name: str) -> dict:
    from transformers import PreTrainedTokenizerFast
    model = load_checkpoint(ckpt)
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    meta = tokenizer_metadata(tok, pre="qwen2") | {
        "general.name": "DeepSeek-V3 demo (13M, Python docs)",
        "general.description": "A tiny DeepSeek-V3-architecture MoE trained on the English prose of the Python "
                               "3.11 documentation, bundled with ktransformers for demos and tests.",
        "general.license": "Apache-2.0 (weights); training text: Python documentation, PSF License",
        "general.file_type": FILE_TYPES[type_name]}
    out.parent.mkdir(parents=True, exist_ok=True)
    types = write_gguf(out, model.config, model.state_dict(), types=TYPES[type_name], extra_metadata=meta)
    # config + tokenizer in a folder of their own: an HF --model_path for the GGUF. Not beside the GGUF:
    # transformers, asked for the tokenizer of a GGUF, prefers a tokenizer.json in the same folder and
    # then drops the special tokens and chat template the GGUF metadata gives.
    hf_dir = out.parent / "hf"
    model.config.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    size = out.stat().st_size
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    print(f"{out}: {size / 1e6:.2f} MB, tensor types {counts}")
    if size > MAX_BYTES:
        raise SystemExit(f"{out} is {size} bytes, over the {MAX_BYTES} limit: pick a smaller type")
    return types


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1)).item()


def check(ckpt: Path, gguf: Path, corpus: Path | None, threads: int | None) -> None:
    from transformers import PreTrainedTokenizerFast

    from ktransformers.loader import load_model, load_tokenizer
    trained = PreTrainedTokenizerFast.from_pretrained(ckpt)
    rebuilt = load_tokenizer(None, gguf)
    assert rebuilt is not None, "transformers could not rebuild the tokenizer from the GGUF metadata"
    pages = read_pages(corpus) if corpus else []
    texts = pages[:50] + ["Hello, world!  Tabs\tand\nnew lines;  ’quotes’ — and émigré café 12345.", "<|endoftext|>x"]
    for text in texts:
        a, b = trained(text)["input_ids"], rebuilt(text)["input_ids"]
        assert a == b, f"tokenizers disagree on {text[:60]!r}"
        assert rebuilt.decode(b) == trained.decode(a)
    assert (rebuilt.bos_token, rebuilt.eos_token) == (trained.bos_token, trained.eos_token)
    print(f"tokenizer: the GGUF's rebuilds identically on {len(texts)} texts "
          f"({sum(len(t) for t in texts):,} chars)")

    reference = load_checkpoint(ckpt)
    ours = load_model(gguf, dtype=torch.float32, progress=False, cpu_infer=threads).model
    ids = torch.tensor([trained("The list of built-in functions is given in the library reference.")["input_ids"]])
    with torch.no_grad():
        a, b = ours(input_ids=ids, use_cache=False).logits, reference(input_ids=ids, use_cache=False).logits
    print(f"logits vs fp32 checkpoint: relative error {((a - b).norm() / b.norm()).item():.3e}, "
          f"argmax agreement {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.2f}")
    if pages:
        _, val = split_pages(pages)
        stream = encode_pages(trained, val).long()
        n = 4 * 256
        chunk = stream[:n].view(4, 256)
        with torch.no_grad():
            la = nll(ours(input_ids=chunk, use_cache=False).logits, chunk)
            lb = nll(reference(input_ids=chunk, use_cache=False).logits, chunk)
        print(f"held-out loss over {n} tokens: GGUF {la:.3f}, fp32 checkpoint {lb:.3f} "
              f"(log vocab {math.log(len(trained)):.3f})")
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([trained(prompt)["input_ids"]])
        for _ in range(32):
            with torch.no_grad():
                nxt = ours(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            if nxt.item() == trained.eos_token_id:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        print(f"greedy (GGUF): {trained.decode(ids[0].tolist())!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint dir written by train_demo.py")
    p.add_argument("--out", default=str(DEMO / "DeepSeek-V3-demo.gguf"))
    p.add_argument("--type", default="Q8_0", choices=list(TYPES), help="weight type of the 2-D tensors")
    p.add_argument("--corpus", help="the corpus, for a held-out loss and tokenizer checks")
    p.add_argument("--no_check", action="store_true")
    p.add_argument("--threads", type=int, help="CPU kernel threads for the check")
    args = p.parse_args(argv)
    out = Path(args.out)
    write_demo(Path(args.ckpt), out, args.type)
    if not args.no_check:
        check(Path(args.ckpt), out, Path(args.corpus) if args.corpus else None, args.threads)


if __name__ == "__main__":
    main()
