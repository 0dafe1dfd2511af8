"""The bundled demo model (ktransformers/demo, made by scripts/train_demo.py + make_demo_gguf.py):
its files ship and stay small, it loads through load_model with the shipped CPU rules, it gives
transformers' logits on the same (dequantized) weights, and it speaks English."""
import math

import pytest
import torch
from tiny import gguf_numpy_pieces, reference_state_dict, round_like_cpu_kernels
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ktransformers import load_model
from ktransformers.demo import DEMO_DIR, DEMO_GGUF, DEMO_HF_DIR

MAX_BYTES = 16 * 10**6
# Corpus-style English that is not in the corpus (written for this test).
HELD_OUT = ("The function returns a new list containing the names of the files in the given directory. "
            "If the directory does not exist, an exception is raised.")
PROMPTS = ["A module is", "The function returns", "To install Python"]


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_GGUF, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(DEMO_HF_DIR)


def test_files_ship_and_are_small():
    files = [DEMO_GGUF] + [DEMO_HF_DIR / f for f in ("config.json", "tokenizer.json", "tokenizer_config.json")]
    for f in files:
        assert f.is_file(), f"{f} is missing (scripts/make_demo_gguf.py writes it)"
        assert f.stat().st_size <= MAX_BYTES, f"{f} is {f.stat().st_size} bytes"
    # transformers would prefer a tokenizer.json beside the GGUF over the GGUF's own metadata
    assert not (DEMO_DIR / "tokenizer.json").exists()


def test_config_and_tokenizer_from_the_gguf(demo, shipped_tokenizer):
    config = demo.config
    assert config.model_type == "deepseek_v3"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (16, 4, 4, 2)
    assert (config.first_k_dense_replace, config.n_shared_experts, config.kv_lora_rank) == (1, 1, 64)
    tok = demo.tokenizer
    if tok is None:  # transformers builds GGUF tokenizers per release; ours must at least ship its own
        pytest.skip("this transformers cannot rebuild the tokenizer from GGUF metadata")
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" == shipped_tokenizer.eos_token
    for text in (HELD_OUT, "Tabs\tand\nnew lines;  ’quotes’ — café 12345.<|endoftext|>x"):
        assert tok(text)["input_ids"] == shipped_tokenizer(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == text
    chat = [{"role": "system", "content": "Python docs."}, {"role": "user", "content": "The list"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "Python docs.\nThe list"


def test_logits_match_transformers_on_the_dequantized_weights(demo, shipped_tokenizer):
    from gguf import GGUFReader

    from ktransformers.weights.ggml_quants import GGMLType
    types = {t.name: GGMLType(int(t.tensor_type)) for t in GGUFReader(DEMO_GGUF).tensors}
    reference = AutoModelForCausalLM.from_config(demo.config, dtype=torch.float32).eval()
    reference.load_state_dict(reference_state_dict(reference, piece=gguf_numpy_pieces(DEMO_GGUF)))
    round_like_cpu_kernels(reference, types)
    ids = torch.tensor([shipped_tokenizer(HELD_OUT)["input_ids"]])
    with torch.no_grad():
        ours = demo.model(input_ids=ids, use_cache=False).logits
        theirs = reference(input_ids=ids, use_cache=False).logits
    # per position: the reference models the kernels' int8 activation rounding, but a value landing
    # one rounding step apart can flip a near-tie in a router's top-k at some position; the
    # typical position must agree closely and almost every next-token choice must match
    per_position = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1))[0]
    assert per_position.median().item() < 1e-2, per_position
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() > 0.95


def test_speaks_english(demo, shipped_tokenizer):
    tok = shipped_tokenizer
    text = ""
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        for _ in range(12):
            with torch.no_grad():
                nxt = demo.model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        continuation = tok.decode(ids[0].tolist())[len(prompt):]
        assert len(continuation.split()) >= 5, continuation
        text += continuation
    plain = sum(c.isascii() and (c.isalpha() or c in " \n.,;:'’-()") for c in text)
    assert plain / len(text) > 0.85, text
    ids = torch.tensor([tok(HELD_OUT)["input_ids"]])
    with torch.no_grad():
        logits = demo.model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert loss < 0.6 * math.log(demo.config.vocab_size), loss
