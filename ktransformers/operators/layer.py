"""A decoder layer that keeps the original's children and its own forward, plus a CPU decode path.

`KDecoderLayer` replaces a pre-norm MoE decoder layer (x + attn(norm(x)), then x + moe(norm(x)):
Qwen3-MoE, Mixtral) and adopts its children under the same names, so the rules for
`...self_attn`, `...mlp.gate`, `...mlp.experts` still apply. Its forward is the original class's
own forward, run on this module, except for two cases. Where the post-attention norm runs its
Triton kernel (the GPU rule files), the forward is the same steps with the attention's residual
add fused into that norm's launch (_forward_fused, for the FUSABLE_LAYERS), and the layer's last
residual add fused with the next layer's input norm, which it hands over through the model's
RunContext (one launch where an add and a norm were two, a layer; where CPU experts fed from the
GPU stream compute the MoE, the launch reading their output back makes that add and norm too).
And a decode step of one sequence and one token whose layer runs entirely on the C++ CPU kernels (the CPU-only rule
files) takes a path of its own: the kernels called back to back on buffers held by the layer
— the same kernels with the same inputs as the module-by-module path, so the result is the same
to the bit — instead of through the ~25 module calls, argument checks and small torch ops
between them, which on a 2-core machine cost about a quarter of a Qwen3-30B-A3B layer's kernel
time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import BaseInjectedModule, adopt_children
from .registry import OPERATORS

_F32 = 0  # the kernels' dtype code for float32 (kernels.cpu._DTYPE_CODE)

# transformers' decoder layers whose forward is exactly x1 = x + attn(input_norm(x))[0], then
# x1 + mlp(post_norm(x1)) (read in transformers 5.17 and 5.24): _forward_fused runs the same with
# the residual add and post_norm in one launch
FUSABLE_LAYERS = frozenset({"Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer", "MixtralDecoderLayer"})


def layer_index(key: str) -> int | None:
    """N of a decoder layer's key "....layers.N", else None."""
    head, _, last = key.rpartition(".")
    return int(last) if last.isdigit() and head.endswith("layers") else None


@dataclass
class _DecodePlan:
    """What the CPU decode path calls, found once: kernel objects, norm weights, buffers."""

    ext: object
    runtime: object  # the C++ Runtime
    norms: tuple  # (weight, eps) of input, post-attention, q and k norms (q/k: None when absent)
    q: object
    k: object
    v: object
    o: object
    router: object
    moe: object
    top_k: int
    renorm: bool
    heads: int
    kv_heads: int
    d: int
    scale: float
    buf: dict[str, torch.Tensor]
    ptr: dict[str, int]  # the buffers' addresses


def _cpu_linear(module):
    """The C++ Linear of a KTransformersLinear whose generate op is KLinearCPU without a bias."""
    from .linear import KLinearCPU
    op = getattr(module, "ops", {}).get("generate")
    if isinstance(op, KLinearCPU) and op.kernel is not None and op.bias is None:
        return op.kernel._linear
    return None


def _cpu_norm(module):
    from .layernorm import KRMSNorm
    if isinstance(module, KRMSNorm) and module.ext is not None:  # (float32 weight on the CPU)
        return module.weight, module.eps
    return None


class KDecoderLayer(BaseInjectedModule):
    gradient_checkpointing = False  # read by transformers' layer forward wrapper (inference only here)

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        missing = [c for c in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
                   if not hasattr(orig_module, c)]
        if missing:
            raise ValueError(f"{key}: {type(orig_module).__name__} is not a pre-norm decoder layer (no {', '.join(missing)})")
        self._hf_forward = type(orig_module).forward
        adopt_children(self, orig_module)
        for name, value in vars(orig_module).items():  # what that forward reads besides the children
            if not name.startswith("_") and not hasattr(self, name):
                setattr(self, name, value)
        self._plan: _DecodePlan | None | bool = False  # False: not looked for yet; None: not available
        self.cpu_decode = True  # False: always the module-by-module path (tests compare the two)
        self.fused_add_norm = type(orig_module).__name__ in FUSABLE_LAYERS  # False: transformers' forward
        self.index = layer_index(key)  # (the next layer is index + 1 in the RunContext)

    def load(self) -> None:
        self._plan = False
        if self.index is not None:
            self.run_context().decoder_layers[self.index] = self

    def unload(self) -> None:
        self._plan = False
        layers = self.run_context().decoder_layers
        if layers.get(self.index) is self:
            del layers[self.index]

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.cpu_decode and self.phase == "generate" and hidden_states.shape[:-1] == (1, 1):
            out = self._decode_one(hidden_states, kwargs.get("position_embeddings"))
            if out is not None:
                return out
        if self.fused_add_norm and not args and self._post_norm_runs_triton(hidden_states):
            return self._forward_fused(hidden_states, kwargs)
        return self._hf_forward(self, hidden_states, *args, **kwargs)

    def _post_norm_runs_triton(self, x: torch.Tensor) -> bool:
        """Whether the post-attention norm is a KRMSNorm whose forward takes its Triton kernel for
        rows shaped like x (the sum x + attn(x) it normalizes)."""
        from .layernorm import KRMSNorm
        post = self.post_attention_layernorm
        return isinstance(post, KRMSNorm) and post.weight is not None and post.path(x) == "triton"

    def _forward_fused(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """transformers' forward of the FUSABLE_LAYERS with the attention's residual add and the
        post-attention norm in one launch (the same bits: the add rounds as torch's, the norm is
        the Triton norm KRMSNorm runs); the rest through the same children. Where the next layer
        also runs so, this layer's last add and that layer's input norm are one launch too: the
        normalized rows wait in the RunContext for the next layer, which takes them only when its
        input is that very sum."""
        from ..kernels.triton.norm_rope import add_rms_norm
        post, ctx = self.post_attention_layernorm, self.run_context()
        handed, ctx.prenormed = ctx.prenormed, None
        if handed is not None and handed[0] is x and handed[1] is self.input_layernorm:
            normed = handed[2]  # the previous layer's last launch normalized x for this layer
        else:
            normed = self.input_layernorm(x)
        h, _ = self.self_attn(hidden_states=normed, **kwargs)
        if h.shape != x.shape or h.device != x.device:
            x1 = x + h
            return x1 + self.mlp(post(x1))
        x1, h = add_rms_norm(x, h, post.weight, post.eps)
        # the add and the norm below, done by the launch that reads CPU experts' y back where it can
        norm = self._next_input_norm(ctx, x1, x1)
        epilogue = ctx.offer_moe_epilogue(x1, norm) if norm is not None else None
        try:
            y = self.mlp(h)
        finally:
            if epilogue is not None:
                ctx.withdraw_moe_epilogue()
        norm = self._next_input_norm(ctx, x1, y)
        if norm is None:
            return x1 + y
        done = epilogue.done_for(y) if epilogue is not None else None
        if done is not None:
            x2, normed_next = done
        else:
            x2, normed_next = add_rms_norm(x1, y, norm.weight, norm.eps)  # (x2 rounded as x1 + y is)
        ctx.prenormed = (x2, norm, normed_next)
        return x2

    def _next_input_norm(self, ctx, x1: torch.Tensor, y: torch.Tensor):
        """The next decoder layer's input norm where it runs the Triton kernel on rows like x1 and
        that layer takes _forward_fused (the one that reads the hand-over), else None. (The norm
        module's forward, and any hook on it, then does not run for that layer's input.)"""
        from .layernorm import KRMSNorm
        nxt = ctx.decoder_layers.get(self.index + 1) if self.index is not None else None
        if nxt is None or not nxt.fused_add_norm or y.shape != x1.shape or y.device != x1.device:
            return None
        norm = nxt.input_layernorm
        if (not isinstance(norm, KRMSNorm) or norm.weight is None or norm.shape != (x1.shape[-1],)
                or norm.path(x1) != "triton"):
            return None
        return norm if nxt._post_norm_runs_triton(x1) else None

    def _find_plan(self) -> _DecodePlan | None:
        """The kernels of this layer when every part of it runs on the C++ CPU kernels in float32."""
        from .attention import KGQAAttention
        from .experts import KExpertsCPU, KTransformersExperts
        from .gate import KMoEGateSoftmax
        from .moe import KMoEBlock
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(attn, KGQAAttention) or not isinstance(mlp, KMoEBlock) or mlp._has_shared():
            return None
        gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
        if not isinstance(gate, KMoEGateSoftmax) or gate.kernel is None or not isinstance(experts, KTransformersExperts):
            return None
        op = experts.ops.get("generate")
        if (not isinstance(op, KExpertsCPU) or op.kernel is None or experts.hot is not None
                or experts.options.out_device != "cpu"):
            return None
        linears = [_cpu_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        norms = [_cpu_norm(self.input_layernorm), _cpu_norm(self.post_attention_layernorm)]
        qk = [_cpu_norm(getattr(attn, n)) if hasattr(attn, n) else None for n in ("q_norm", "k_norm")]
        if None in linears or None in norms or (hasattr(attn, "q_norm") and None in qk) or attn._cpp_cache() is None:
            return None
        H, d, E = gate.hidden_dim, attn.head_dim, gate.weight_shape[0]
        heads, kv = attn.num_heads, attn.num_kv_heads
        sizes = {"h": H, "q": heads * d, "k": kv * d, "v": kv * d, "qn": heads * d, "kn": kv * d,
                 "attn": heads * d, "o": H, "x1": H, "h2": H, "logits": E, "y": H}
        buf = {name: torch.empty(1, n, dtype=torch.float32) for name, n in sizes.items()}
        runtime = attn._runtime
        return _DecodePlan(runtime.ext, runtime._rt, tuple(norms + qk), *linears, gate.kernel._linear,
                           op.kernel._moe, gate.top_k, gate.norm, heads, kv, d, float(attn.scaling), buf,
                           {name: t.data_ptr() for name, t in buf.items()})

    def _decode_one(self, x: torch.Tensor, position_embeddings) -> torch.Tensor | None:
        """x [1, 1, H] float32 -> the layer's output, or None when this step is not the CPU case."""
        if self._plan is False:
            self._plan = self._find_plan()
        p = self._plan
        batch = self.self_attn.context.batch if self.self_attn.context is not None else None
        if (p is None or batch is None or len(batch.q_lens) != 1 or position_embeddings is None
                or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous()
                or x.shape[-1] != p.buf["h"].shape[1]):
            return None
        cos, sin = position_embeddings
        if (cos.numel() != p.d or sin.numel() != p.d or cos.dtype != torch.float32 or sin.dtype != torch.float32
                or not (cos.is_contiguous() and sin.is_contiguous())):
            return None
        caches = self.self_attn._cpp_cache()  # (the engine's cache: float32 on the CPU, else None)
        if caches is None:
            return None
        read = batch.read_slots[0]
        if read.dtype != torch.int64 or not read.is_contiguous():
            return None
        b, ptr, ext = p.buf, p.ptr, p.ext
        (w_in, eps_in), (w_post, eps_post), qn, kn = p.norms
        ext.rms_norm(x.data_ptr(), w_in.data_ptr(), eps_in, 1, x.shape[-1], ptr["h"])
        p.q.forward(1, ptr["h"], ptr["q"], _F32)
        p.k.forward(1, ptr["h"], ptr["k"], _F32)
        p.v.forward(1, ptr["h"], ptr["v"], _F32)
        q, k = ptr["q"], ptr["k"]
        if qn is not None:  # per-head RMSNorm of q and k (Qwen3)
            ext.rms_norm(q, qn[0].data_ptr(), qn[1], p.heads, p.d, ptr["qn"])
            ext.rms_norm(k, kn[0].data_ptr(), kn[1], p.kv_heads, p.d, ptr["kn"])
            q, k = ptr["qn"], ptr["kn"]
        k_cache, v_cache = caches
        # RoPE on q and k in place, k and v stored at the step's slot, attention over the history
        # (the C++ side checks every slot against the cache before any write)
        p.runtime.rope_write_attend_gqa(q, k, ptr["v"], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                        v_cache.data_ptr(), k_cache.shape[0], int(batch.slots[0]), read.data_ptr(),
                                        read.numel(), p.heads, p.kv_heads, p.d, p.scale, ptr["attn"])
        p.o.forward(1, ptr["attn"], ptr["o"], _F32)
        x1 = torch.add(x.view(1, -1), b["o"], out=b["x1"])
        ext.rms_norm(ptr["x1"], w_post.data_ptr(), eps_post, 1, x1.shape[-1], ptr["h2"])
        p.router.forward(1, ptr["h2"], ptr["logits"], _F32)
        weights, ids = torch.softmax(b["logits"], dim=-1).topk(p.top_k, dim=-1)
        if p.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        p.moe.forward(1, ids.data_ptr(), weights.data_ptr(), ptr["h2"], ptr["y"], _F32)
        return (x1 + b["y"]).view(x.shape)


OPERATORS.register("KDecoderLayer")(KDecoderLayer)
