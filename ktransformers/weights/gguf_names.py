"""HF <-> GGUF tensor names, one declarative table per llama.cpp architecture.

Names are what llama.cpp's convert_hf_to_gguf.py writes. `{i}` is the block (layer) index and
`{e}` an expert index (old per-expert Mixtral files). A transform is how the converter changed
the tensor; load() undoes it: "unpermute_q"/"unpermute_k" undo llama's Q/K row permutation,
"plus_one" subtracts the 1 added to zero-centred norm weights, "neg_exp" takes log(-x) of a
stored -exp(x).
Virtual HF names (not parameters of the HF model) are composed by WeightSource:
`experts.{gate,up,down}_proj` [E, ...] (and their `_bias` [E, ...]), DeepSeek's `k_b_proj`/`v_b_proj`
and Qwen3-Next's `in_proj_qkv`/`in_proj_z`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NameMap:
    hf: str
    gguf: str
    transform: str = ""


def _m(hf: str, gguf: str, transform: str = "") -> NameMap:
    return NameMap(hf, gguf, transform)


L = "model.layers.{i}."
B = "blk.{i}."

_GLOBAL = (
    _m("model.embed_tokens.weight", "token_embd.weight"),
    _m("model.norm.weight", "output_norm.weight"),
    _m("lm_head.weight", "output.weight"),
)
_BLOCK = (
    _m(L + "input_layernorm.weight", B + "attn_norm.weight"),
    _m(L + "post_attention_layernorm.weight", B + "ffn_norm.weight"),
    _m(L + "self_attn.o_proj.weight", B + "attn_output.weight"),
)

# GLM-4.5's and gpt-oss's converters keep the post-attention norm's own GGUF name (not ffn_norm)
_BLOCK_POST_ATTENTION_NORM = (_BLOCK[0], _BLOCK[2],
                              _m(L + "post_attention_layernorm.weight", B + "post_attention_norm.weight"))


def _gqa(permute: bool = False, bias: bool = False, qk_norm: bool = False) -> tuple[NameMap, ...]:
    q, k = ("unpermute_q", "unpermute_k") if permute else ("", "")
    out = [
        _m(L + "self_attn.q_proj.weight", B + "attn_q.weight", q),
        _m(L + "self_attn.k_proj.weight", B + "attn_k.weight", k),
        _m(L + "self_attn.v_proj.weight", B + "attn_v.weight"),
    ]
    if bias:
        out += [_m(L + f"self_attn.{p}_proj.bias", B + f"attn_{p}.bias") for p in "qkv"]
    if qk_norm:
        out += [_m(L + "self_attn.q_norm.weight", B + "attn_q_norm.weight"),
                _m(L + "self_attn.k_norm.weight", B + "attn_k_norm.weight")]
    return tuple(out)


def _mlp(hf: str, suffix: str) -> tuple[NameMap, ...]:
    return tuple(_m(L + f"{hf}.{p}_proj.weight", B + f"ffn_{p}{suffix}.weight") for p in ("gate", "up", "down"))


_ROUTED = (
    _m(L + "mlp.gate.weight", B + "ffn_gate_inp.weight"),
    *(_m(L + f"mlp.experts.{p}_proj", B + f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")),
)
# gpt-oss: a router with a bias, experts with biases (HF: gate_up_proj [E, H, 2I] with gate and
# up interleaved, down_proj [E, I, H]; the converter splits and transposes them to the stacks
# below, whose HF-side names are the composed [E, out, in] ones WeightSource gives)
_BIASED_ROUTED = (
    _m(L + "mlp.router.weight", B + "ffn_gate_inp.weight"),
    _m(L + "mlp.router.bias", B + "ffn_gate_inp.bias"),
    *(_m(L + f"mlp.experts.{p}_proj", B + f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")),
    *(_m(L + f"mlp.experts.{p}_proj_bias", B + f"ffn_{p}_exps.bias") for p in ("gate", "up", "down")),
)
_PER_EXPERT = tuple(
    _m(L + "mlp.experts.{e}." + f"{p}_proj.weight", B + f"ffn_{p}." + "{e}.weight") for p in ("gate", "up", "down"))

# Multi-token-prediction (next-n) layers as GLM-4.5's converter keeps them, after the main layers:
# mapped so that they are recognised (and skipped: the HF model does not build them).
_NEXTN = (
    _m(L + "eh_proj.weight", B + "nextn.eh_proj.weight"),
    _m(L + "enorm.weight", B + "nextn.enorm.weight"),
    _m(L + "hnorm.weight", B + "nextn.hnorm.weight"),
    _m(L + "embed_tokens.weight", B + "nextn.embed_tokens.weight"),
    _m(L + "shared_head.norm.weight", B + "nextn.shared_head_norm.weight"),
    _m(L + "shared_head.head.weight", B + "nextn.shared_head_head.weight"),
)

_MLA = (
    _m(L + "self_attn.q_proj.weight", B + "attn_q.weight"),
    _m(L + "self_attn.q_a_proj.weight", B + "attn_q_a.weight"),
    _m(L + "self_attn.q_a_layernorm.weight", B + "attn_q_a_norm.weight"),
    _m(L + "self_attn.q_b_proj.weight", B + "attn_q_b.weight"),
    _m(L + "self_attn.kv_a_proj_with_mqa.weight", B + "attn_kv_a_mqa.weight"),
    _m(L + "self_attn.kv_a_layernorm.weight", B + "attn_kv_a_norm.weight"),
    _m(L + "self_attn.kv_b_proj.weight", B + "attn_kv_b.weight"),
    _m(L + "self_attn.k_b_proj.weight", B + "attn_k_b.weight"),
    _m(L + "self_attn.v_b_proj.weight", B + "attn_v_b.weight"),
)

def _plus_one(maps: tuple[NameMap, ...]) -> tuple[NameMap, ...]:
    """Zero-centred RMSNorm weights (Qwen3-Next's): the converter stores 1 + w."""
    return tuple(NameMap(m.hf, m.gguf, "plus_one") for m in maps)


# Qwen3-Next's gated DeltaNet layers. The converter splits in_proj_qkvz (rows per key head: its q,
# k, then the v and z of the value heads it serves) into attn_qkv (all q, all k, all v) and
# attn_gate (all z); WeightSource composes in_proj_qkvz back from these two (virtual HF names,
# which are Qwen3.5's own). It stores -exp(A_log) as ssm_a and the conv1d weight squeezed.
_DELTANET = (
    _m(L + "linear_attn.in_proj_qkv.weight", B + "attn_qkv.weight"),
    _m(L + "linear_attn.in_proj_z.weight", B + "attn_gate.weight"),
    _m(L + "linear_attn.in_proj_ba.weight", B + "ssm_ba.weight"),
    _m(L + "linear_attn.conv1d.weight", B + "ssm_conv1d.weight"),
    _m(L + "linear_attn.dt_bias", B + "ssm_dt.bias"),
    _m(L + "linear_attn.A_log", B + "ssm_a", "neg_exp"),
    _m(L + "linear_attn.norm.weight", B + "ssm_norm.weight"),
    _m(L + "linear_attn.out_proj.weight", B + "ssm_out.weight"),
)

def _hybrid(deltanet: tuple[NameMap, ...]) -> tuple[NameMap, ...]:
    """Qwen3-Next's and Qwen3.5-MoE's maps: every RMSNorm but the DeltaNet's gated one is
    zero-centred; q_proj keeps each head's query and output gate together; Qwen2-MoE's routed and
    sigmoid-gated shared experts; the DeltaNet's tensors."""
    norms = _plus_one((_GLOBAL[1], _BLOCK_POST_ATTENTION_NORM[0], _BLOCK_POST_ATTENTION_NORM[2]))
    return ((_GLOBAL[0], _GLOBAL[2]) + norms + (_BLOCK[2],) + _gqa() + _plus_one(_gqa(qk_norm=True)[3:]) + _ROUTED
            + _mlp("mlp.shared_expert", "_shexp")
            + (_m(L + "mlp.shared_expert_gate.weight", B + "ffn_gate_inp_shexp.weight"),) + deltanet)


ARCH_NAMES: dict[str, tuple[NameMap, ...]] = {
    "deepseek2": _GLOBAL + _BLOCK + _MLA + _ROUTED + _mlp("mlp", "") + _mlp("mlp.shared_experts", "_shexp") + (
        _m(L + "mlp.gate.e_score_correction_bias", B + "exp_probs_b.bias"),),
    "qwen3moe": _GLOBAL + _BLOCK + _gqa(qk_norm=True) + _ROUTED,
    "qwen2moe": _GLOBAL + _BLOCK + _gqa(bias=True) + _ROUTED + _mlp("mlp.shared_expert", "_shexp") + (
        _m(L + "mlp.shared_expert_gate.weight", B + "ffn_gate_inp_shexp.weight"),),
    "glm4moe": _GLOBAL + _BLOCK_POST_ATTENTION_NORM + _gqa(bias=True, qk_norm=True) + _ROUTED + _mlp("mlp", "")
    + _mlp("mlp.shared_experts", "_shexp") + (
        _m(L + "mlp.gate.e_score_correction_bias", B + "exp_probs_b.bias"),) + _NEXTN,
    "gpt-oss": _GLOBAL + _BLOCK_POST_ATTENTION_NORM + (_m(L + "self_attn.o_proj.bias", B + "attn_output.bias"),
                                                     _m(L + "self_attn.sinks", B + "attn_sinks.weight"))
    + _gqa(bias=True) + _BIASED_ROUTED,
    # MiniMax-M2: q/k norms over all heads at once ([heads * d]), the correction bias on the MoE block
    "minimax-m2": _GLOBAL + _BLOCK + _gqa(qk_norm=True) + _ROUTED + (
        _m(L + "mlp.e_score_correction_bias", B + "exp_probs_b.bias"),),
    "llama": _GLOBAL + _BLOCK + _gqa(permute=True) + _ROUTED + _PER_EXPERT + _mlp("mlp", ""),
    "qwen3next": _hybrid(_DELTANET),
    # Qwen3.5-MoE (text): the DeltaNet's projections one each, value heads stored tiled (TILED_VALUE_HEADS)
    "qwen35moe": _hybrid(tuple(m for m in _DELTANET if "in_proj_ba" not in m.hf) + (
        _m(L + "linear_attn.in_proj_b.weight", B + "ssm_beta.weight"),
        _m(L + "linear_attn.in_proj_a.weight", B + "ssm_alpha.weight"))),
}
# architectures whose converter reorders a DeltaNet's value heads from transformers' grouped order
# (by key head) to tiled (value head j reads key head j % key heads), in every tensor that has them
TILED_VALUE_HEADS = frozenset({"qwen35moe"})
# transforms that change values, not row order (undone by load(); raw bytes are never used for them)
VALUE_TRANSFORMS = ("plus_one", "neg_exp")

# Tensors a file may carry that no HF parameter uses: never an error when left unread.
IGNORABLE_GGUF = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.(nextn\.|attn_rot_embd).*)$")
# HF names composed from others, so that their parts count as read when they are.
DERIVED_HF = re.compile(r"\.self_attn\.[kv]_b_proj\.weight$")


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(f"^{escaped}$")


class GGUFNameTable:
    """Translate one architecture's GGUF tensor names to HF names (and back)."""

    def __init__(self, arch: str):
        if arch not in ARCH_NAMES:
            raise ValueError(f"no HF<->GGUF name map for architecture {arch!r}; supported: {', '.join(ARCH_NAMES)}")
        self.arch = arch
        self.maps = ARCH_NAMES[arch]
        self._gguf_patterns = [(_pattern(m.gguf), m) for m in self.maps]

    def to_hf(self, gguf_name: str) -> tuple[str, str] | None:
        """(HF name, transform) for a GGUF tensor name, or None when the table does not know it."""
        for pattern, entry in self._gguf_patterns:
            match = pattern.match(gguf_name)
            if match:
                return entry.hf.format(**match.groupdict()), entry.transform
        return None

    def transform_of(self, hf_name: str) -> str:
        """How the converter changes the HF tensor `hf_name` ("" for not at all)."""
        for entry in self.maps:
            if _pattern(entry.hf).match(hf_name):
                return entry.transform
        return ""

    def to_gguf(self, hf_name: str) -> str | None:
        for entry in self.maps:
            match = _pattern(entry.hf).match(hf_name)
            if match:
                return entry.gguf.format(**match.groupdict())
        return None
