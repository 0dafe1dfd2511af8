"""KDecoderLayer: a pre-norm MoE decoder layer (x + attn(norm(x)), then x + moe(norm(x)): Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5, gpt-oss, MiniMax-M2; the hybrids Qwen3-Next and Qwen3.5-MoE, whose
linear-attention layers hold `linear_attn` where the others hold `self_attn`) that keeps the original's children under the same names, so the rules for
`...self_attn`, `...mlp.gate`, `...mlp.experts` still apply, and runs one of three plans, chosen
once after load (`LayerPlan`):

    hf          transformers' own forward of the original class, run on this module
    fused       the same steps, the attention's residual add fused into the post-attention norm's
                Triton launch, and the layer's last add fused with the next layer's input norm
                (GPU rule files): in the launch that reads CPU experts' y back from pinned memory
                where it can, else in one add-and-norm launch. The next layer receives that norm
                from the engine's layer loop (`step`), not through shared state.
    cpu_decode  a one-token decode step whose layer runs entirely on the C++ CPU kernels (CPU-only
                rule files): the kernels called back to back on buffers the plan holds, the same
                kernels with the same inputs as module by module, so the same result to the bit,
                without the ~25 module calls, argument checks and small torch ops between them.
                A gate or router other than KMoEGateSoftmax (GLM's, gpt-oss's) and shared experts
                other than the sigmoid-gated kind are called as the modules they are; a DeltaNet
                layer's mixer is KGatedDeltaNet.cpu_step.

Where a step does not fit its plan's kernels (more rows than the Triton norm takes, several
sequences in a CPU decode step), it runs the `hf` steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import BaseInjectedModule, adopt_children
from .registry import OPERATORS

_F32 = 0  # the kernels' dtype code for float32 (kernels.cpu._DTYPE_CODE)

# transformers' decoder layers whose forward is exactly x1 = x + attn(input_norm(x))[0], then
# x1 + mlp(post_norm(x1)) (read in transformers 5.17 and 5.25): the fused plan runs the same with
# the residual add and post_norm in one launch
FUSABLE_LAYERS = frozenset({"Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer", "MixtralDecoderLayer",
                            "Glm4MoeDecoderLayer", "MiniMaxM2DecoderLayer"})


@dataclass
class CpuDecode:
    """What the cpu_decode plan calls, found once: kernel objects, norm weights, buffers."""

    ext: object
    runtime: object  # the C++ Runtime
    norms: tuple  # (weight, eps) of input, post-attention, q and k norms (q/k: None when absent)
    router: object  # the C++ linear of a KMoEGateSoftmax gate, routed here; None: `route` routes
    route: object  # None, or the router module's call: h [1, H] -> (weights [1, K], ids [1, K])
    shared: object  # None, or the MoE block's shared experts: h [1, H] -> [1, H]
    moe: object
    top_k: int
    renorm: bool
    buf: dict[str, torch.Tensor]
    ptr: dict[str, int]  # the buffers' addresses
    mixer: object = None  # a linear-attention layer's step h [1, H] -> [1, H] or None; else the attention's:
    q: object = None
    k: object = None
    v: object = None
    o: object = None
    biases: tuple = (None,) * 4  # float32 biases of q, k, v and o (None where a projection has none)
    heads: int = 0
    kv_heads: int = 0
    d: int = 0
    rotary: int = 0  # the leading values of each head RoPE rotates
    norm_all_heads: bool = False  # the q and k norms span all heads (MiniMax-M2), not each head
    window: int = 0  # a sliding-window layer's window, else 0
    sinks: torch.Tensor | None = None  # [heads] float32 (gpt-oss)
    scale: float = 0.0
    gated: bool = False  # q_proj gives each head's query, then its output gate (Qwen3-Next, Qwen3.5)


def _triton_norm(norm, like=None):
    """`norm` where it is a KRMSNorm the fused add + norm computes (`fusable`) with the Triton
    kernel (shaped and placed as `like`, a norm, when given), else None."""
    from .layernorm import KRMSNorm
    if not isinstance(norm, KRMSNorm) or not norm.fusable or norm.weight is None or norm.triton_norm is None:
        return None
    if like is not None and (norm.shape != like.shape or norm.weight.device != like.weight.device):
        return None
    return norm


def link_decoder_layers(layers) -> None:
    """Tell each KDecoderLayer which layer follows it (the fused plan computes that one's input
    norm); their plans are made again on next use."""
    layers = list(layers)
    for layer, nxt in zip(layers, layers[1:] + [None]):
        if isinstance(layer, KDecoderLayer):
            layer._next = (nxt,) if nxt is not None else ()
            layer._plan = None


def _cpu_route(mlp):
    """How the cpu_decode plan routes a token through `mlp`: (C++ linear of a KMoEGateSoftmax gate,
    None) routed inline, or (None, the gate's or router module's call -> (weights, ids)); None
    where the block is not a MoE of these kinds."""
    from .gate import KMoEGateSoftmax
    from .moe import KMoEBlock
    if isinstance(mlp, KMoEBlock):
        gate = getattr(mlp, "gate", None)
        if isinstance(gate, KMoEGateSoftmax) and gate.kernel is not None:
            return gate.kernel._linear, None
        return None, lambda h: gate(h)[1:]
    router = getattr(mlp, "router", None)  # gpt-oss: transformers' own top-k router
    if type(mlp).__name__ == "GptOssMLP" and isinstance(router, nn.Module):
        return None, lambda h: router(h)[1:]
    return None


def _cpu_norm(module):
    from .layernorm import KRMSNorm
    if isinstance(module, KRMSNorm) and module.ext is not None:  # (float32 weight on the CPU)
        return module.weight, module.eps
    return None


@dataclass(frozen=True)
class LayerPlan:
    """How a KDecoderLayer runs (the module doc's three plans): `fused` with the next layer's
    input norm `next_norm` (None: this layer's last add stays alone), and `cpu_decode` where
    one-token decode steps run on the C++ kernels back to back."""

    fused: bool = False
    next_norm: nn.Module | None = None  # a KRMSNorm
    moe_epilogue: bool = False  # the MoE block may do that add and norm in its read-back launch
    cpu_decode: CpuDecode | None = None


class KDecoderLayer(BaseInjectedModule):
    gradient_checkpointing = False  # read by transformers' layer forward wrapper (inference only here)

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        mixer = "linear_attn" if hasattr(orig_module, "linear_attn") else "self_attn"  # (hybrids' DeltaNet layers)
        missing = [c for c in ("input_layernorm", mixer, "post_attention_layernorm", "mlp")
                   if not hasattr(orig_module, c)]
        if missing:
            raise ValueError(f"{key}: {type(orig_module).__name__} is not a pre-norm decoder layer (no {', '.join(missing)})")
        self._hf_forward = type(orig_module).forward
        adopt_children(self, orig_module)
        for name, value in vars(orig_module).items():  # what that forward reads besides the children
            if not name.startswith("_") and not hasattr(self, name):
                setattr(self, name, value)
        self._plan: LayerPlan | None = None  # made on first use after load (or a change of the switches below)
        self._next: tuple = ()  # (the next decoder layer,), set by link_decoder_layers: not a child module
        self._cpu_decode = True  # False: never the cpu_decode plan (tests compare the plans)
        self._fused_add_norm = type(orig_module).__name__ in FUSABLE_LAYERS  # False: never the fused plan

    @property
    def cpu_decode(self) -> bool:
        return self._cpu_decode

    @cpu_decode.setter
    def cpu_decode(self, value: bool) -> None:
        self._cpu_decode, self._plan = bool(value), None

    @property
    def fused_add_norm(self) -> bool:
        return self._fused_add_norm

    @fused_add_norm.setter
    def fused_add_norm(self, value: bool) -> None:
        self._fused_add_norm, self._plan = bool(value), None

    def load(self) -> None:
        self._plan = None

    def unload(self) -> None:
        self._plan = None

    @property
    def plan(self) -> LayerPlan:
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> LayerPlan:
        fused = self._fused_add_norm and _triton_norm(self.post_attention_layernorm) is not None
        nxt = self._next[0] if self._next else None
        next_norm = None
        if fused and isinstance(nxt, KDecoderLayer) and nxt.fused_add_norm:
            next_norm = _triton_norm(nxt.input_layernorm, like=self.post_attention_layernorm)
        from .moe import KMoEBlock
        return LayerPlan(fused=fused, next_norm=next_norm, moe_epilogue=isinstance(self.mlp, KMoEBlock),
                         cpu_decode=self._find_cpu_decode() if self._cpu_decode else None)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return self.step(hidden_states, None, *args, **kwargs)[0]

    def step(self, x: torch.Tensor, normed: torch.Tensor | None, *args, **kwargs):
        """x -> (the layer's output, the next layer's input norm of it where this layer computed
        it, else None). `normed`: this layer's input norm of x, computed by the layer before."""
        plan = self.plan
        if plan.cpu_decode is not None and self.phase == "generate" and x.shape[:-1] == (1, 1):
            out = self._decode_one(x, kwargs.get("position_embeddings"))
            if out is not None:
                return out, None
        if plan.fused and not args and self.post_attention_layernorm.path(x) == "triton":
            return self._forward_fused(x, normed, plan, kwargs)
        return self._hf_forward(self, x, *args, **kwargs), None

    def _forward_fused(self, x: torch.Tensor, normed: torch.Tensor | None, plan: LayerPlan, kwargs: dict):
        """transformers' forward of the FUSABLE_LAYERS with the attention's residual add and the
        post-attention norm in one launch (the same bits: the add rounds as torch's, the norm is
        the Triton norm KRMSNorm runs), and the last add with the next layer's input norm."""
        from ..kernels.triton.norm_rope import add_rms_norm
        post = self.post_attention_layernorm
        h, _ = self.self_attn(hidden_states=self.input_layernorm(x) if normed is None else normed, **kwargs)
        if h.shape != x.shape or h.device != x.device:
            x1 = x + h
            return x1 + self.mlp(post(x1)), None
        x1, h = add_rms_norm(x, h, post.weight, post.eps)
        norm = plan.next_norm if plan.next_norm is not None and plan.next_norm.path(x1) == "triton" else None
        if norm is None:
            return x1 + self.mlp(h), None
        epilogue = None
        if plan.moe_epilogue and x1.is_cuda:
            from ..kernels.cuda_host import MoEEpilogue
            epilogue = MoEEpilogue(x1, norm.weight, norm.eps)
        y = self.mlp(h) if epilogue is None else self.mlp(h, epilogue=epilogue)
        if y.shape != x1.shape or y.device != x1.device:
            return x1 + y, None
        done = epilogue.done_for(y) if epilogue is not None else None
        return done if done is not None else add_rms_norm(x1, y, norm.weight, norm.eps)  # (x2 rounded as x1 + y)

    def _find_cpu_decode(self) -> CpuDecode | None:
        """The kernels of this layer where every part of it runs on the C++ CPU kernels in float32
        (a gate or router module, and shared experts without a direct form, called as they are)."""
        moe = self._cpu_moe()
        norms = [_cpu_norm(self.input_layernorm), _cpu_norm(self.post_attention_layernorm)]
        if moe is None or None in norms:
            return None
        H, logits = norms[0][0].shape[0], moe.pop("logits")
        mixer = getattr(self, "linear_attn", None)
        if mixer is not None:  # a hybrid's linear-attention layer: its own one-token step
            step = mixer.cpu_step() if hasattr(mixer, "cpu_step") else None
            if step is None:
                return None
            buf = _buffers({"h": H, "x1": H, "h2": H, "y": H, "logits": logits}, moe["top_k"])
            return CpuDecode(ext=mixer._runtime.ext, runtime=mixer._runtime._rt, norms=(*norms, None, None), **moe,
                             buf=buf, ptr={name: t.data_ptr() for name, t in buf.items()}, mixer=step)
        return self._attention_decode(moe, norms, H, logits)

    def _attention_decode(self, moe: dict, norms: list, H: int, logits: int) -> CpuDecode | None:
        from .attention import KGQAAttention
        from .linear import cpu_kernel
        attn = self.self_attn
        if not isinstance(attn, KGQAAttention) or attn._runtime is None:  # (the cache is checked each step)
            return None
        linears = [cpu_kernel(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        qk = [_cpu_norm(getattr(attn, n)) if hasattr(attn, n) else None for n in ("q_norm", "k_norm")]
        if None in linears or (hasattr(attn, "q_norm") and None in qk):
            return None
        d, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        buf = _buffers({"h": H, "q": heads * d * (2 if attn.gated else 1), "qg": heads * d, "k": kv * d, "v": kv * d,
                        "qn": heads * d, "kn": kv * d, "attn": heads * d, "o": H, "x1": H, "h2": H, "y": H,
                        "logits": logits}, moe["top_k"])
        (q, bq), (k, bk), (v, bv), (o, bo) = linears
        return CpuDecode(ext=attn._runtime.ext, runtime=attn._runtime._rt, norms=tuple(norms + qk), q=q, k=k, v=v, o=o,
                         biases=(bq, bk, bv, bo), **moe, heads=heads, kv_heads=kv, d=d, rotary=attn.rotary_dim,
                         norm_all_heads=attn.norm_all_heads, window=attn.window or 0, sinks=attn.sinks,
                         scale=float(attn.scaling), buf=buf, ptr={name: t.data_ptr() for name, t in buf.items()},
                         gated=attn.gated)

    def _cpu_moe(self) -> dict | None:
        """The MoE half of the cpu_decode plan (CpuDecode's router, route, shared, moe, top_k and
        renorm; `logits`: the router's width), or None where the block is not run so."""
        from .experts import KExpertsCPU, KTransformersExperts
        from .moe import KMoEBlock
        mlp = self.mlp
        route, experts = _cpu_route(mlp), getattr(mlp, "experts", None)
        if route is None or not isinstance(experts, KTransformersExperts):
            return None
        op = experts.ops.get("generate")
        if (not isinstance(op, KExpertsCPU) or op.kernel is None or experts.hot is not None
                or experts.options.out_device != "cpu"):
            return None
        shared = (mlp.shared_call() or mlp._shared) if isinstance(mlp, KMoEBlock) and mlp._has_shared() else None
        gate = mlp.gate if route[0] is not None else None  # (a KMoEGateSoftmax, routed inline)
        return dict(router=route[0], route=route[1], shared=shared, moe=op.kernel._moe,
                    top_k=gate.top_k if gate is not None else 0, renorm=gate.norm if gate is not None else False,
                    logits=gate.weight_shape[0] if gate is not None else 1)

    def _decode_one(self, x: torch.Tensor, position_embeddings) -> torch.Tensor | None:
        """x [1, 1, H] float32 -> the layer's output, or None when this step is not the CPU case."""
        p = self.plan.cpu_decode
        batch = self.context.batch if self.context is not None else None
        if (p is None or batch is None or len(batch.q_lens) != 1 or x.dtype != torch.float32
                or x.device.type != "cpu" or not x.is_contiguous() or x.shape[-1] != p.buf["x1"].shape[1]):
            return None
        (w_in, eps_in), (w_post, eps_post) = p.norms[:2]
        p.ext.rms_norm(x.data_ptr(), w_in.data_ptr(), eps_in, 1, x.shape[-1], p.ptr["h"])
        out = p.mixer(p.buf["h"]) if p.mixer is not None else self._attend_one(p, batch, position_embeddings)
        if out is None:  # (before any state or cache was written)
            return None
        x1 = torch.add(x.view(1, -1), out, out=p.buf["x1"])
        p.ext.rms_norm(p.ptr["x1"], w_post.data_ptr(), eps_post, 1, x1.shape[-1], p.ptr["h2"])
        return (x1 + self._moe_one(p)).view(x.shape)

    def _attend_one(self, p: CpuDecode, batch, position_embeddings) -> torch.Tensor | None:
        """The attention half of a cpu_decode step, on the input norm in p.buf["h"] -> o_proj's
        output [1, H] (p.buf), or None when the step does not fit (then nothing was written)."""
        if position_embeddings is None:
            return None
        cos, sin = position_embeddings
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.numel() != sin.numel():
            return None
        if 2 * cos.numel() == p.rotary:  # one factor per rotated pair (gpt-oss's tables), as the attention does
            cos, sin = torch.cat([cos.view(-1), cos.view(-1)]), torch.cat([sin.view(-1), sin.view(-1)])
        if cos.numel() != p.rotary or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        caches = self.self_attn._cpp_cache()  # (the engine's cache: float32 on the CPU, else None)
        read = batch.read_slots[0]
        if caches is None or read.dtype != torch.int64 or not read.is_contiguous():
            return None
        if p.window and read.numel() > p.window:  # a sliding-window layer sees its last `window` slots
            read = read[-p.window:]
        b, ptr, ext = p.buf, p.ptr, p.ext
        qn, kn = p.norms[2:]
        for name, linear, bias in (("q", p.q, p.biases[0]), ("k", p.k, p.biases[1]), ("v", p.v, p.biases[2])):
            linear.forward(1, ptr["h"], ptr[name], _F32)
            if bias is not None:
                b[name].add_(bias)
        q, k = ptr["q"], ptr["k"]
        if p.gated:  # per head: d query values, then d gate values
            b["qg"].view(p.heads, p.d).copy_(b["q"].view(p.heads, 2 * p.d)[:, :p.d])
            q = ptr["qg"]
        if qn is not None:  # RMSNorm of q and k, per head (Qwen3) or over all heads (MiniMax-M2)
            q_rows, k_rows = (1, 1) if p.norm_all_heads else (p.heads, p.kv_heads)
            ext.rms_norm(q, qn[0].data_ptr(), qn[1], q_rows, p.heads * p.d // q_rows, ptr["qn"])
            ext.rms_norm(k, kn[0].data_ptr(), kn[1], k_rows, p.kv_heads * p.d // k_rows, ptr["kn"])
            q, k = ptr["qn"], ptr["kn"]
        k_cache, v_cache = caches
        # RoPE on q and k in place, k and v stored at the step's slot, attention over the history
        # (the C++ side checks every slot against the cache before any write)
        p.runtime.rope_write_attend_gqa(q, k, ptr["v"], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                        v_cache.data_ptr(), k_cache.shape[0], int(batch.slots[0]), read.data_ptr(),
                                        read.numel(), p.heads, p.kv_heads, p.d, p.scale, ptr["attn"],
                                        0 if p.sinks is None else p.sinks.data_ptr(), p.rotary)
        if p.gated:
            gate = b["q"].view(p.heads, 2 * p.d)[:, p.d:].reshape(1, -1)
            torch.mul(b["attn"], torch.sigmoid(gate), out=b["attn"])
        p.o.forward(1, ptr["attn"], ptr["o"], _F32)
        return b["o"] if p.biases[3] is None else b["o"].add_(p.biases[3])

    @staticmethod
    def _moe_one(p: CpuDecode) -> torch.Tensor:
        """The MoE half of a cpu_decode step, on the post-attention norm in p.buf["h2"] -> [1, H]."""
        b, ptr = p.buf, p.ptr
        if p.route is None:  # (the gate module's CPU route: the same two kernels)
            p.router.forward(1, ptr["h2"], ptr["logits"], _F32)
            p.ext.softmax_topk(ptr["logits"], 1, b["logits"].shape[1], p.top_k, p.renorm, ptr["w"], ptr["ids"])
            ids, weights = b["ids"], b["w"]
        else:
            weights, ids = p.route(b["h2"])
            ids, weights = ids.to("cpu", torch.int64).contiguous(), weights.to("cpu", torch.float32).contiguous()
        p.moe.forward(1, ids.data_ptr(), weights.data_ptr(), ptr["h2"], ptr["y"], _F32)
        return b["y"] if p.shared is None else b["y"] + p.shared(b["h2"])


def _buffers(sizes: dict[str, int], top_k: int) -> dict[str, torch.Tensor]:
    """float32 rows of `sizes`, and a token's routing: "w" (weights) and "ids" (int64) of top_k."""
    buf = {name: torch.empty(1, n, dtype=torch.float32) for name, n in {**sizes, "w": max(top_k, 1)}.items()}
    buf["ids"] = torch.empty(1, max(top_k, 1), dtype=torch.int64)
    return buf


OPERATORS.register("KDecoderLayer")(KDecoderLayer)
