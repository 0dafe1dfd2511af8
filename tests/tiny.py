"""Tiny random models of each family (transformers' own classes) and the reference weights a
GGUF of them should load as: each tensor in GGUF layout, quantized by us, dequantized by the
`gguf` package's numpy code (an independent decoder), then put back into HF layout."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MiniMaxM2Config,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers import Qwen3_5MoeTextConfig

from ktransformers.weights.ggml_quants import GGMLType, quantize
from ktransformers.weights.gguf_write import converter_tensors, join_hf

FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "minimax_m2",
            "qwen3_next", "qwen3_5_moe_text")
RULES = {"deepseek_v3": "DeepSeek-V3-Chat-cpu.yaml", "deepseek_v2": "DeepSeek-V2-Chat-cpu.yaml", "qwen3_moe": "Qwen3Moe-cpu.yaml",
         "qwen2_moe": "Qwen2Moe-cpu.yaml", "mixtral": "Mixtral-cpu.yaml", "glm4_moe": "Glm4Moe-cpu.yaml",
         "gpt_oss": "GptOss-cpu.yaml", "minimax_m2": "MiniMaxM2-cpu.yaml", "qwen3_next": "Qwen3Next-cpu.yaml",
         "qwen3_5_moe_text": "Qwen35Moe-cpu.yaml"}


def tiny_config(family: str, hidden: int = 256, layers: int = 3) -> PretrainedConfig:
    common = dict(vocab_size=320, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return DeepseekV3Config(**common, intermediate_size=512, moe_intermediate_size=256, num_key_value_heads=4,
                                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
                                v_head_dim=32, qk_nope_head_dim=32, routed_scaling_factor=2.5)
    if family == "deepseek_v2":  # V2-Lite's shape: q_proj without the low-rank split, greedy softmax routing
        return DeepseekV2Config(**common, intermediate_size=512, moe_intermediate_size=256, num_key_value_heads=4,
                                n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                                first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
                                v_head_dim=32, qk_nope_head_dim=32, routed_scaling_factor=1.0)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                              moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**common, num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=256,
                              shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=False)
    if family == "mixtral":
        return MixtralConfig(**common, num_key_value_heads=2, intermediate_size=256, num_local_experts=5,
                             num_experts_per_tok=2)
    if family == "glm4_moe":  # partial rotary, q/k norms, attention biases, a dense first layer, a shared expert
        return Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                             moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                             num_nextn_predict_layers=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if family == "gpt_oss":  # sinks, a sliding window shorter than the tests' prompts, biases everywhere, YaRN
        return GptOssConfig(**common, num_key_value_heads=2, head_dim=64, intermediate_size=256, num_local_experts=6,
                            num_experts_per_tok=2, sliding_window=8, swiglu_limit=7.0, attention_bias=True,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 8})
    if family == "minimax_m2":  # q/k norms over all heads, partial rotary, sigmoid routing with the bias on the block
        return MiniMaxM2Config(**common, num_key_value_heads=2, head_dim=64, intermediate_size=256, num_local_experts=8,
                               num_experts_per_tok=2, bos_token_id=0, eos_token_id=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5})
    if family == "qwen3_next":  # gated DeltaNet layers (2 value heads a key head), gated attention every 4th
        return Qwen3NextConfig(**{**common, "num_hidden_layers": max(layers, 4)}, num_key_value_heads=2, head_dim=64,
                               intermediate_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                               linear_conv_kernel_dim=4)
    if family == "qwen3_5_moe_text":  # Qwen3.5-MoE's text model: the DeltaNet's four projections, MRoPE
        return Qwen3_5MoeTextConfig(**{**common, "num_hidden_layers": max(layers, 4)}, num_key_value_heads=2,
                                    head_dim=64, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                    num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                    linear_conv_kernel_dim=4,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2]})
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits some weights to zero/one; make every tensor random and non-trivial
        for name, p in model.named_parameters():
            one = name.endswith("norm.weight") and not _zero_centred(model.config, name)
            # (a DeltaNet's convolution as strong as a trained one's: q and k of a tiny norm would
            # make their L2 norms, and so the model, hypersensitive)
            scale = 0.5 if name.endswith("conv1d.weight") else 0.02 if p.dim() > 1 else 0.1
            p.copy_(torch.randn_like(p) * scale + (1.0 if one else 0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.01)
    return model


HYBRID = ("qwen3_next", "qwen3_5_moe_text")  # gated DeltaNet beside attention


def _zero_centred(config, name: str) -> bool:
    """A norm weight the model uses as 1 + w (Qwen3-Next's, but for its DeltaNet's gated norm)."""
    return config.model_type in HYBRID and name.endswith("norm.weight") and ".linear_attn." not in name


def _roundtrip(t: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    data = quantize(t.contiguous(), ggml_type).numpy().reshape(*t.shape[:-1], -1)
    return torch.from_numpy(np.array(np_dequantize(data, GGMLQuantizationType(int(ggml_type))), dtype=np.float32))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_numpy_pieces(path) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Tensors of a GGUF file read and dequantized by the gguf package alone (not our loader)."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def piece(gguf_name: str, like: torch.Tensor) -> torch.Tensor:
        t = tensors[gguf_name]
        values = np_dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(like.shape)
    return piece


def reference_state_dict(model, types: dict[str, GGMLType] | None = None, split_kv_b: bool = True,
                         piece=None) -> dict[str, torch.Tensor]:
    """What each HF tensor becomes after the trip through a GGUF written with `types` (or, with
    `piece(gguf_name, tensor)`, as read from an existing file)."""
    config, out = model.config, {}
    piece = piece or (lambda g, t: _roundtrip(t, types[g]))
    for name, tensor in model.state_dict().items():
        pieces = converter_tensors({name: tensor}, config, split_kv_b)
        back = {g: piece(g, t) for g, t in pieces.items()}
        if config.model_type == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            out[name] = _unpermute(next(iter(back.values())), heads)
        else:
            out[name] = join_hf(name, list(back.values()), config, tuple(tensor.shape), split_kv_b)
        if config.model_type in HYBRID and name.endswith("A_log"):  # stored as -exp(A_log)
            out[name] = torch.log(-out[name])
        elif _zero_centred(config, name):
            out[name] = out[name] - 1  # zero-centred norms are stored as 1 + w
    return out


def train_tokenizer(vocab: int = 320):
    """A fresh byte-level BPE tokenizer (the shape of Qwen's and DeepSeek's) on a little English."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def round_like_cpu_kernels(reference, types: dict[str, GGMLType] | GGMLType) -> None:
    """Make a transformers model round activations as the CPU kernels do for the GGUF it is
    compared with (`types`: its tensors' types by GGUF name, or one type for every weight): the
    input of every linear and expert projection whose weight is quantized goes to int8 steps per
    block, and that of BF16 weights to bf16 (ktransformers.kernels.cpu.round_activations)."""
    from ktransformers.kernels.cpu import ACTIVATION_BLOCK, round_activations
    from ktransformers.weights.gguf_config import arch_of
    from ktransformers.weights.gguf_names import GGUFNameTable
    table = GGUFNameTable(arch_of(reference.config))

    def block_of(hf_name: str):
        if isinstance(types, GGMLType):
            return ACTIVATION_BLOCK.get(int(types))
        # (Qwen3-Next's in_proj_qkvz is stored as attn_qkv and attn_gate, which share a type in these files)
        gguf = table.to_gguf(hf_name.replace("in_proj_qkvz.", "in_proj_qkv."))
        return ACTIVATION_BLOCK.get(int(types[gguf])) if gguf in types else None

    # the router runs in torch; MLA folds kv_b_proj's dequantized weight into its attention math;
    # the hybrids' CPU rule files keep the shared expert's one-row gate in torch
    in_torch = ("mlp.gate", "kv_b_proj") + (("shared_expert_gate",) if reference.config.model_type in HYBRID else ())
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(in_torch):
            block = block_of(f"{name}.weight")
            if block:
                module.register_forward_pre_hook(lambda m, args, b=block: (round_activations(args[0], b),))
        elif name.endswith("mlp.experts"):
            blocks = [block_of(f"{name}.{p}_proj") for p in ("gate", "up", "down")]
            module.forward = _rounding_experts(module, blocks)


def canonical_experts(module):
    """(gate_up [E, 2I, H], down [E, H, I], (gate_up bias [E, 2I], down bias [E, H]) or None) of
    transformers' fused experts, whatever their layout (gpt-oss's are transposed and interleaved)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    interleaved = not getattr(module, "is_concatenated", True)
    if interleaved:
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    bias = None
    if getattr(module, "has_bias", False):
        b = module.gate_up_proj_bias
        bias = (torch.cat([b[:, 0::2], b[:, 1::2]], dim=1) if interleaved else b, module.down_proj_bias)
    return gate_up, down, bias


def _rounding_experts(module, blocks):
    from ktransformers.kernels.cpu import round_activations
    from ktransformers.operators.experts import moe_reference
    from ktransformers.operators.experts.module import expert_activation
    bg, bu, bd = blocks
    gate_up, down, bias = canonical_experts(module)

    def forward(x, top_k_index, top_k_weights):
        return moe_reference(x, top_k_index, top_k_weights, gate_up, down,
                             lambda t: round_activations(t, bg), lambda t: round_activations(t, bd),
                             lambda t: round_activations(t, bu), act=expert_activation(module), bias=bias)
    return forward


def reference_rules(family: str, tmp_path) -> Path:
    """The shipped CPU rule file with the pure-torch ops in place of the C++ kernels."""
    from ktransformers.loader import RULES_DIR
    text = (RULES_DIR / RULES[family]).read_text()
    path = tmp_path / f"{family}-reference.yaml"
    path.write_text(text.replace("KExpertsCPU", "KExpertsTorch").replace("KLinearCPU", "KLinearTorch"))
    return path


GPU_RULES = {"deepseek_v3": "DeepSeek-V3-Chat.yaml", "deepseek_v2": "DeepSeek-V2-Chat.yaml", "qwen3_moe": "Qwen3Moe.yaml", "qwen2_moe": "Qwen2Moe.yaml",
             "mixtral": "Mixtral.yaml", "glm4_moe": "Glm4Moe.yaml", "gpt_oss": "GptOss.yaml",
             "minimax_m2": "MiniMaxM2.yaml", "qwen3_next": "Qwen3Next.yaml",
             "qwen3_5_moe_text": "Qwen35Moe.yaml"}


def with_experts_kwargs(rules: Path, tmp_path, **kwargs) -> Path:
    """A copy of the rule file `rules` whose every experts rule (KTransformersExperts) has
    `kwargs` added to its own, written under tmp_path."""
    import yaml
    parsed = yaml.safe_load(Path(rules).read_text())
    for rule in parsed:
        replace = rule.get("replace") or {}
        if str(replace.get("class", "")).rsplit(".", 1)[-1] == "KTransformersExperts":
            replace.setdefault("kwargs", {}).update(kwargs)
    path = Path(tmp_path) / f"with-{'-'.join(kwargs)}-{Path(rules).name}"
    path.write_text(yaml.safe_dump(parsed, sort_keys=False))
    return path


def kernel_device() -> str:
    """Where the Triton kernels run in this session: 'cuda', or 'cpu' under Triton's interpreter
    (Triton >= 3.9; older interpreters fail on NumPy 2.4). Skips the test when neither works."""
    import pytest
    if torch.cuda.is_available():
        return "cuda"
    try:
        import triton
    except ImportError:
        pytest.skip("needs CUDA, or Triton (>= 3.9) for its CPU interpreter: pip install 'triton>=3.9'")
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails on this NumPy; needs CUDA or Triton >= 3.9")
    return "cpu"


def gpu_rules(family: str, tmp_path, device: str, experts_extra: str = "") -> Path:
    """The shipped GPU rule file, its cuda placements moved to `device` ('cpu' runs the Triton
    kernels in the interpreter); `experts_extra` is YAML added to the experts rule's kwargs."""
    from ktransformers.loader import RULES_DIR
    text = (RULES_DIR / GPU_RULES[family]).read_text()
    if device != "cuda":
        text = text.replace("cuda", device)
    if experts_extra:
        text = text.replace("      out_device:", f"      {experts_extra}\n      out_device:")
    path = tmp_path / f"{family}-gpu.yaml"
    path.write_text(text)
    return path


def wait_all(requests, timeout: float = 300) -> None:
    """Wait until every scheduler request has ended (a hang guard: a failure past `timeout`)."""
    deadline = time.monotonic() + timeout
    while any(r.t_done is None for r in requests):
        assert time.monotonic() < deadline, "the scheduler did not finish"
        time.sleep(0.01)


def record_cpu_steps(layers) -> list[bool]:
    """Wrap each KDecoderLayer's _decode_one so that the list returned records, call by call,
    whether it ran its CPU decode step."""
    took: list[bool] = []
    for m in layers:
        m._decode_one = lambda *a, real=m._decode_one: (lambda out: took.append(out is not None) or out)(real(*a))
    return took


def logits_of_both_plans(model, layers, ids: list[int], prompt: int) -> list[torch.Tensor]:
    """The logits of a prefill of ids[:prompt] (in chunks of 7) and a decode of the rest, with the
    KDecoderLayers' CPU decode step on, then off."""
    from ktransformers.engine.generate import Engine
    results = []
    for cpu_decode in (True, False):
        for m in layers:
            m.cpu_decode = cpu_decode
        engine = Engine(model, cache_lens=64, page_size=4, chunk_size=7)
        seq = engine.new_sequence()
        results.append(torch.stack([engine.prefill(seq, ids[:prompt])[0]] +
                                   [engine.decode(seq, t)[0] for t in ids[prompt:]]))
        engine.release(seq)
    return results


def two_at_once_as_alone(model, ids: list[int], took: list[bool]) -> None:
    """Two sequences fed one token each in one step take the module-by-module path (`took`, where
    a KDecoderLayer's wrapped _decode_one records whether it ran its CPU step, stays without a
    True) and each gets the logits it gets alone (relative error < 1e-5)."""
    from ktransformers.engine.generate import Engine
    engine = Engine(model, cache_lens=64, page_size=4, max_batch=2)
    sa, sb = engine.new_sequence(), engine.new_sequence()
    engine.prefill(sa, ids[:9])
    engine.prefill(sb, ids[20:25])
    took.clear()
    both = engine.step([sa, sb], [[ids[9]], [ids[25]]])
    assert not any(took)
    alone = Engine(model, cache_lens=64, page_size=4)
    for i, (prompt, token) in enumerate(((ids[:9], ids[9]), (ids[20:25], ids[25]))):
        s = alone.new_sequence()
        alone.prefill(s, prompt)
        want = alone.decode(s, token)[0]
        assert ((both[i] - want).norm() / want.norm()).item() < 1e-5
