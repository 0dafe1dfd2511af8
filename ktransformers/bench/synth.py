"""Write a GGUF with an architecture's real tensor names and shapes, filled with random valid
blocks of a chosen type: realistic-size benchmark models without a download.

    python -m ktransformers.bench.synth --model qwen3-30b-a3b --layers 4 --type Q4_K_M --out /tmp/q3.gguf
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from ..loader import build_skeleton
from ..weights.ggml_quants import FORMATS, GGMLType, ggml_type, quantize, random_blocks
from ..weights.gguf_write import converter_type, write_gguf

# Shapes of real models (from their published config.json), trimmed to what the skeleton needs.
PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        n_group=8, topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, routed_scaling_factor=2.5,
                        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=163840),
    # Kimi-K2 / K2-Thinking: DeepSeek-V3's architecture with one expert group and 384 experts
    "kimi-k2": dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
                    n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1,
                    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                    qk_nope_head_dim=128, routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-6,
                    max_position_embeddings=131072,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 4096}),
    # GLM-4.5-Air (its next-n layer left out: the model never runs it)
    "glm-4.5-air": dict(model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                        moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
                        num_key_value_heads=8, head_dim=128, n_shared_experts=1, n_routed_experts=128,
                        num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                        routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True, use_qk_norm=False,
                        num_nextn_predict_layers=0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
    # GLM-4.6 (GLM-4.5: the same shape, 131072 positions), its next-n layer left out as GLM-4.5-Air's
    "glm-4.6": dict(model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288,
                    moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
                    head_dim=128, n_shared_experts=1, n_routed_experts=160, num_experts_per_tok=8, n_group=1,
                    topk_group=1, first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
                    attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
                    max_position_embeddings=202752,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
    "deepseek-v2": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
                        moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=2, n_routed_experts=160, num_experts_per_tok=6,
                        topk_method="group_limited_greedy", n_group=8, topk_group=3, first_k_dense_replace=1,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        routed_scaling_factor=16.0, rms_norm_eps=1e-6, max_position_embeddings=163840),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                             topk_method="greedy", first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                             qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, routed_scaling_factor=1.0,
                             rms_norm_eps=1e-6, max_position_embeddings=163840),
    # gpt-oss: MXFP4 experts in the published files (--type MXFP4_MOE)
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                        rms_norm_eps=1e-5, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    # Qwen3-Next-80B-A3B: gated DeltaNet in three layers of four, gated attention in the fourth
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=48,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=512,
                               num_experts_per_tok=10, norm_topk_prob=True, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                "partial_rotary_factor": 0.25}),
    # Qwen3.5-35B-A3B's text model (the shape of transformers' Qwen3_5MoeTextConfig defaults)
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256,
                            num_experts_per_tok=8, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                            rms_norm_eps=1e-6, max_position_embeddings=262144,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}),
    # MiniMax-M2 / M2.1: q/k norms over all heads, rotary on half of each head, sigmoid routing with a bias
    "minimax-m2": dict(model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
                       num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                       num_local_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6, max_position_embeddings=196608,
                       bos_token_id=None, eos_token_id=None,  # (the synthetic tokenizer names its own)
                       rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=32768),
}
PRESETS["gpt-oss-120b"] = dict(PRESETS["gpt-oss-20b"], num_hidden_layers=36, num_local_experts=128)


def preset_config(name: str, layers: int | None = None, experts: int | None = None,
                  vocab: int | None = None) -> PretrainedConfig:
    return config_from_fields(dict(PRESETS[name]), layers, experts, vocab)


def config_from_fields(fields: dict, layers: int | None = None, experts: int | None = None,
                       vocab: int | None = None) -> PretrainedConfig:
    """An HF config from config.json fields, with the layer, routed-expert and vocabulary counts overridden."""
    fields = dict(fields)
    model_type = fields.pop("model_type")
    if layers:
        fields["num_hidden_layers"] = layers
    if experts:
        key = next(k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in fields)
        fields[key] = experts
    if vocab:
        fields["vocab_size"] = vocab
    fields["num_nextn_predict_layers"] = 0  # the file holds no next-n (MTP) layer; GGUF's block_count then counts none
    return AutoConfig.for_model(model_type, **fields)


def q4_k_m(name: str, shape: tuple[int, ...]) -> GGMLType:
    """llama-quantize's Q4_K_M, simplified: Q6_K for attn_v, ffn_down* and output; Q4_K elsewhere."""
    more_bits = "attn_v" in name or "ffn_down" in name or name == "output.weight"
    return converter_type(GGMLType.Q6_K if more_bits else GGMLType.Q4_K)(name, shape)


def mxfp4_moe(name: str, shape: tuple[int, ...]) -> GGMLType:
    """llama-quantize's MXFP4_MOE (the published gpt-oss files): the routed experts MXFP4, the rest Q8_0."""
    return GGMLType.MXFP4 if name.endswith("_exps.weight") else converter_type(GGMLType.Q8_0)(name, shape)


def type_chooser(name: str):
    choosers = {"Q4_K_M": q4_k_m, "MXFP4_MOE": mxfp4_moe}
    return choosers.get(name.upper()) or converter_type(ggml_type(name))


POOL_BYTES = 32 << 20


def random_encoder(seed: int = 0):
    """Random valid blocks for every tensor: per type, a pool of POOL_BYTES of random blocks made
    once, each tensor a run of it from a random start, wrapping around (writing a DeepSeek-V3-size
    file is then bound by the disk, not the random generator; the kernels' speed does not depend
    on the values, and every tensor still has its own bytes in the file and in RAM)."""
    gen = torch.Generator().manual_seed(seed)
    pools: dict[GGMLType, torch.Tensor] = {}

    def encode(tensor: torch.Tensor, t: GGMLType) -> torch.Tensor:
        if not tensor.is_meta:  # (values given: write_synthetic's vectors)
            return quantize(tensor, t)
        n = tensor.numel() // FORMATS[t].block_elems
        if t not in pools:
            pools[t] = random_blocks(t, max(1, POOL_BYTES // FORMATS[t].block_bytes), gen)
        pool = pools[t]
        start = int(torch.randint(0, pool.shape[0], (1,), generator=gen))
        reps = -(-(start + n) // pool.shape[0])
        return (pool.repeat(reps, 1) if reps > 1 else pool)[start:start + n].reshape(-1)
    return encode


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_chars() -> list[str]:
    """The byte-level alphabet: the character GPT-2's byte-level BPE writes for each byte 0..255."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
              *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in direct:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def synthetic_vocab(size: int) -> dict:
    """`tokenizer.ggml.*` keys of a byte-level BPE vocabulary of exactly `size` tokens (the kind the
    MoE families ship: llama.cpp's "gpt2" model, "qwen2" pre-tokenizer): the 256 byte tokens, then
    the merges of every pair of printable ASCII characters, then of pair + character, as many as
    fit, and ChatML's three special tokens last, with ChatML as the chat template. transformers and
    llama.cpp both build it, so chat and serving benchmarks run on a synthetic file as it is."""
    first = 256 + len(SPECIAL_TOKENS)
    if size < first:
        raise ValueError(f"a synthetic vocabulary needs at least {first} tokens, got {size}")
    byte = _byte_chars()
    printable = [byte[b] for b in range(32, 127)]  # space is 'Ġ'
    want = size - first
    merges: list[str] = []
    pairs = [(a, b) for a in printable for b in printable]
    for a, b in pairs[:want]:
        merges.append(f"{a} {b}")
    for a, b in pairs:
        if len(merges) >= want:
            break
        merges.extend(f"{a + b} {c}" for c in printable[:want - len(merges)])
    if len(merges) < want:
        raise ValueError(f"a synthetic vocabulary holds at most {first + len(pairs) * (1 + len(printable))} tokens, "
                         f"got {size}")
    tokens = byte + [m.replace(" ", "") for m in merges] + list(SPECIAL_TOKENS)
    eot, _, im_end = range(size - len(SPECIAL_TOKENS), size)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (size - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS),
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": eot, "tokenizer.ggml.eos_token_id": im_end,
            "tokenizer.ggml.padding_token_id": eot, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHATML}


def write_synthetic(config: PretrainedConfig, out: str | Path, type_name: str = "Q4_K_M", seed: int = 0) -> dict:
    skeleton = build_skeleton(config, torch.float32)
    # vectors (norms, biases, a DeltaNet's A_log and dt_bias) of ones: values every family reads as
    # valid (A_log is stored as -exp(A_log), which must be negative); matrices random
    state = {name: torch.ones(t.shape) if t.dim() == 1 else t for name, t in skeleton.state_dict().items()}
    return write_gguf(out, config, state, types=type_chooser(type_name), encode=random_encoder(seed),
                      extra_metadata=synthetic_vocab(config.vocab_size))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help=f"preset shape: {', '.join(PRESETS)}")
    p.add_argument("--config", help="an HF config.json to take the shape from instead of a preset")
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--experts", type=int, help="override the routed expert count")
    p.add_argument("--vocab", type=int, help="override vocab_size")
    p.add_argument("--type", default="Q4_K_M", help="Q4_K_M, MXFP4_MOE or a ggml type name (Q8_0, Q4_K, BF16, ...)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.config:
        config = config_from_fields(json.loads(Path(a.config).read_text()), a.layers, a.experts, a.vocab)
    else:
        config = preset_config(a.model, a.layers, a.experts, a.vocab)
    types = write_synthetic(config, a.out, a.type)
    size = sum(p.stat().st_size for p in Path(a.out).parent.glob(Path(a.out).stem + "*.gguf"))
    print(f"wrote {a.out}: {len(types)} tensors, {size / 2**20:.1f} MiB, {config.model_type}, "
          f"{config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
