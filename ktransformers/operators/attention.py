"""Attention over the paged caches: MLA (DeepSeek-V2/V3, Kimi-K2) and grouped-query attention
(Qwen3-MoE, Qwen2-MoE, Mixtral). Torch reference implementations, and the Triton decode kernels (`backend`) where they run.

Both keep the original module's projections as children (so linear rules still match
`...self_attn.q_a_proj` etc.) and keep HF's forward signature and `(output, weights)` return.
When the engine has set a `ForwardBatch` on the run context, the input is the step's packed
tokens `[1, N, H]` of several sequences: each writes its new cache entries and attends over its
own history. With no batch set, each row of `[B, S, H]` is attended causally without a cache.

MLA shapes (h heads, r = kv_lora_rank, n/p/v = nope/rope/value head dims): the cache keeps per
token the normalised latent c [r] and the rotated shared key k_rot [p]. With absorbed weights
(decode) W_kv_b = [W_uk; W_uv] per head is folded into the query and the output:
    score(t, j) = (q_nope W_uk) · c_j + q_rot · k_rot_j,   out = (Σ_j p_j c_j) W_uvᵀ
so attention runs in the r-dim latent space and keys/values are never expanded. Prefill expands
them once per chunk (k_nope, v = c W_kv_bᵀ), cheaper for many query tokens, unless
`absorb_for_prefill` is set.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..cache.paged import PagedCache
from ..kernels.cpu import attend_gqa_decode, rope_write_attend_gqa
from .base import BaseInjectedModule, Placement, adopt_children, choices
from .registry import OPERATORS
from .rope import complex_to_cos_sin


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE (rotate-half pairs) on q, k [B, S, heads, d] over the first cos.shape[-1] dims of each
    head; the rest pass unrotated (GLM-4.5's and MiniMax-M2's partial rotary)."""
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


def _full_tables(cos: torch.Tensor, sin: torch.Tensor, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin with a factor for every rotated dim (each pair's twice where `pairs`)."""
    return (torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)) if pairs else (cos, sin)


def causal_mask(q_len: int, start: int, kv_len: int, window: int | None, device) -> torch.Tensor | None:
    """Bool [q_len, kv_len]: query i (at position start+i) sees keys j <= start+i (and, with a
    sliding window, j > start+i-window). None when every query sees every key."""
    if q_len == 1 and not window:
        return None
    qpos = torch.arange(start, start + q_len, device=device)[:, None]
    kpos = torch.arange(kv_len, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v for q [h, q, d], k/v [h_kv, L, d] (h a multiple of h_kv):
    explicit matmuls for a few query rows (SDPA's CPU kernel costs far more there; the caller
    stacks grouped heads), SDPA's 4-D flash path with native GQA for prefill-sized blocks.
    `sinks` [h, q]: each row's sink logit (gpt-oss), a key without value that takes its share of
    the softmax; then h == h_kv, and the rows go in blocks of SINK_ROWS (bounded scores)."""
    if sinks is not None:
        return _attend_sinks(q, k, v, mask, scale, sinks)
    if q.shape[1] > 16:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                             enable_gqa=k.shape[0] != q.shape[0])
        return out[0]
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v)


SINK_ROWS = 512


def _attend_sinks(q, k, v, mask, scale, sinks) -> torch.Tensor:
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=v.dtype, device=v.device)
    for r in range(0, q.shape[1], SINK_ROWS):
        rows = slice(r, r + SINK_ROWS)
        scores = torch.bmm(q[:, rows], k.transpose(1, 2)).mul_(scale)
        if mask is not None:
            scores.masked_fill_(~mask[rows], float("-inf"))
        probs = torch.softmax(torch.cat([scores, sinks[:, rows, None].to(scores.dtype)], dim=-1), dim=-1)
        out[:, rows] = torch.bmm(probs[..., :-1], v)
    return out


BACKENDS = ("auto", "torch", "triton")

# Up to this many tokens a step's q/k norms and RoPE run in one Triton launch (decode-sized:
# the ~14 small torch ops cost more than the work); longer steps keep torch's ops
TRITON_ROPE_TOKENS = 64


@dataclass(frozen=True)
class AttentionOptions(Placement):
    # auto: the Triton kernels on CUDA devices, the torch reference (and C++ decode) on the CPU
    backend: str = field(default="auto", metadata=choices(lambda: list(BACKENDS)))


class _CachedAttention(BaseInjectedModule):
    """Shared plumbing: per-sequence spans of the packed step, cache write, history read."""

    Options = AttentionOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        adopt_children(self, orig_module)
        self.layer_idx = orig_module.layer_idx
        self.scaling = float(orig_module.scaling)
        self.triton = False  # decided by load(): the Triton kernels read the cache
        self.batched_decode = False  # _decode_all also serves several sequences on the torch path

    def _choose_backend(self) -> None:
        from ..kernels.triton.common import require, triton_available
        backend = self.options.backend
        if backend == "triton":
            require(self.device, f"{self.key}: backend triton")
        self.triton = backend == "triton" or (backend == "auto" and self.device.type == "cuda" and triton_available())

    def _decode_all(self, queries: tuple[torch.Tensor, ...], batch) -> torch.Tensor:
        """Every sequence's one new token at once (Triton backend): [B, ...] outputs."""
        raise NotImplementedError

    def _run(self, token_entries: list[torch.Tensor], queries: tuple[torch.Tensor, ...], batch_rows: int,
             seq_len: int, written: bool = False) -> torch.Tensor:
        """token_entries: this step's cache entries [T, ...]; queries: per-token query tensors
        [T, ...]. Returns the stacked per-token outputs of `self._attend` [T, ...]. `written`: a
        kernel has already stored the entries in the cache."""
        ctx = self.context
        batch = ctx.batch if ctx is not None else None
        outputs = []
        if batch is None:  # no cache: each row is one sequence from position 0
            for b in range(batch_rows):
                rows = slice(b * seq_len, (b + 1) * seq_len)
                outputs.append(self._attend(*(q[rows] for q in queries), *(e[rows] for e in token_entries), start=0))
            return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if batch_rows != 1 or seq_len != batch.num_tokens:
            raise ValueError(f"{self.key}: a ForwardBatch of {batch.num_tokens} tokens needs hidden_states of shape "
                             f"[1, {batch.num_tokens}, H], got [{batch_rows}, {seq_len}, H]")
        if not written:
            ctx.cache.write(self.layer_idx, batch, *token_entries)
        one_each = all(q == 1 for q in batch.q_lens)
        if one_each and (self.triton or (len(batch.q_lens) > 1 and self.batched_decode)):
            return self._decode_all(queries, batch)
        for i, first, q_len, start in batch.spans():
            rows = slice(first, first + q_len)
            outputs.append(self._attend_cached(tuple(q[rows] for q in queries), batch, i, start))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _attend_cached(self, queries: tuple[torch.Tensor, ...], batch, i: int, start: int) -> torch.Tensor:
        """Sequence i's queries against its whole cached history (gathered, then `_attend`)."""
        return self._attend(*queries, *self.context.cache.read(self.layer_idx, batch, i), start=start)


@dataclass(frozen=True)
class MLAOptions(AttentionOptions):
    absorb_for_prefill: bool = False  # attend in latent space for many-token chunks too (less memory)


class KDeepseekV2Attention(_CachedAttention):
    """Multi-head latent attention over KDeepSeekV3Cache (torch reference)."""

    Options = MLAOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        o = orig_module
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = o.num_heads, o.q_lora_rank, o.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = o.qk_nope_head_dim, o.qk_rope_head_dim, o.v_head_dim
        # V3's rotary pairs are interleaved where its config says so; V2's always are (its rotary
        # embedding gives complex factors, which rope.complex_to_cos_sin turns into V3's tables)
        self.rope_interleave = bool(getattr(config, "rope_interleave", config.model_type == "deepseek_v2"))
        self.w_uk = self.w_uv = None
        self.batched_decode = True

    def load(self) -> None:
        h, n, v, r = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w = self.weights.load(f"{self.key}.kv_b_proj.weight", self.device, torch.float32, shape=(h * (n + v), r))
        w = w.view(h, n + v, r)
        self.w_uk, self.w_uv = w[:, :n].contiguous(), w[:, n:].contiguous()  # [h, n, r], [h, v, r]
        self._choose_backend()

    def unload(self) -> None:
        self.w_uk = self.w_uv = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        B, S, _ = hidden_states.shape
        h, n, p, r = self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(B, S, h, n + p).transpose(1, 2)
        q_nope, q_rot = q.split([n, p], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([r, p], dim=-1)
        c = self.kv_a_layernorm(c)
        cos, sin = complex_to_cos_sin(position_embeddings) if torch.is_tensor(position_embeddings) else position_embeddings
        rotate = hf_deepseek.apply_rotary_pos_emb_interleave if self.rope_interleave else hf_deepseek.apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot.view(B, 1, S, p), cos, sin)
        dev = self.device
        latent = torch.cat([c.reshape(B * S, r), k_rot.reshape(B * S, p).to(c.dtype)], dim=-1).to(dev)
        q_nope = q_nope.transpose(1, 2).reshape(B * S, h, n).to(dev)
        q_rot = q_rot.transpose(1, 2).reshape(B * S, h, p).to(dev)
        out = self._run([latent], (q_nope, q_rot), B, S)  # [T, h, v]
        out = out.to(hidden_states.dtype).reshape(B, S, h * self.v_dim)
        return self.o_proj(out), None

    def _decode_all(self, queries, batch) -> torch.Tensor:
        """Every sequence's query against its latent history, in latent space: the Triton kernel
        reads the cache in place; the torch path gathers the histories padded to the longest and
        masks the padding (one batched computation instead of a loop over sequences)."""
        q_nope, q_rot = queries
        r = self.kv_lora_rank
        (latent,) = self.context.cache.layers[self.layer_idx]  # [slots, r + p]
        slots, lens = batch.slot_table(latent.device)
        if not self.triton:
            history = latent[slots.long()].float()  # [B, L, r + p]
            c, k_rot = history.split([r, self.rope_dim], dim=-1)
            q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), self.w_uk)
            scores = (torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_rot.float(), k_rot.transpose(1, 2)))
            scores = scores.mul_(self.scaling)
            padding = torch.arange(slots.shape[1], device=slots.device)[None, :] >= lens[:, None]
            scores.masked_fill_(padding[:, None, :], float("-inf"))
            o_lat = torch.bmm(torch.softmax(scores, dim=-1), c)  # [B, h, r]
            return torch.einsum("bhr,hvr->bhv", o_lat, self.w_uv)
        from ..kernels.triton.attention import decode_attention
        q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), self.w_uk)
        o_lat = decode_attention(q_lat, latent[:, None, :r], None, slots, lens, self.scaling, q2=q_rot,
                                 k2=latent[:, None, r:])
        return torch.einsum("thr,hvr->thv", o_lat, self.w_uv)

    def _attend_triton(self, q_nope, q_rot, history, start: int) -> torch.Tensor:
        """Triton prefill: causal flash attention over the expanded keys/values (k_rot shared by
        every head), or in latent space with absorb_for_prefill."""
        from ..kernels.triton.attention import prefill_attention
        c, k_rot = history.float().split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.options.absorb_for_prefill:
            q_lat = torch.einsum("qhn,hnr->qhr", q_nope.float(), self.w_uk)
            o_lat = prefill_attention(q_lat, c[:, None], c[:, None], start, self.scaling, q2=q_rot, k2=k_rot[:, None])
            return torch.einsum("qhr,hvr->qhv", o_lat, self.w_uv)
        kv = torch.einsum("lr,hkr->lhk", c, torch.cat([self.w_uk, self.w_uv], dim=1))  # [L, h, n + v]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return prefill_attention(q_nope, k_nope, v, start, self.scaling, q2=q_rot, k2=k_rot[:, None])

    def _attend(self, q_nope, q_rot, history, start: int) -> torch.Tensor:
        """q_nope [q, h, n], q_rot [q, h, p], history [L, r + p] -> [q, h, v] (float32 math)."""
        if self.triton:
            return self._attend_triton(q_nope, q_rot, history, start)
        q_len, L = q_nope.shape[0], history.shape[0]
        mask = causal_mask(q_len, start, L, None, history.device)
        c, k_rot = history.float().split([self.kv_lora_rank, self.rope_dim], dim=-1)
        absorb = q_len == 1 or self.options.absorb_for_prefill
        if absorb:
            q_lat = torch.einsum("qhn,hnr->hqr", q_nope.float(), self.w_uk)
            scores = (q_lat @ c.T + torch.einsum("qhp,lp->hql", q_rot.float(), k_rot)) * self.scaling
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o_lat = torch.softmax(scores, dim=-1) @ c  # [h, q, r]
            return torch.einsum("hqr,hvr->qhv", o_lat, self.w_uv)
        kv = torch.einsum("lr,hkr->hlk", c, torch.cat([self.w_uk, self.w_uv], dim=1))  # [h, L, n + v]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[None].expand(self.num_heads, L, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1).float().transpose(0, 1)  # [h, q, n + p]
        out = attend(q, k, v, mask, self.scaling)
        return out.transpose(0, 1)


def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The attention's output times sigmoid(gate) (gated attention), where the layer has a gate."""
    return out if gate is None else out * torch.sigmoid(gate.to(out.device))


class KGQAAttention(_CachedAttention):
    """Grouped-query attention over KGQACache (torch reference); Qwen3's per-head q/k norms,
    Qwen2's q/k/v biases (inside the projections), partial rotary, sliding windows, gpt-oss's
    per-head sinks and Qwen3-Next's output gate are honoured."""

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        o = orig_module
        self.head_dim = o.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is None or layer_types[self.layer_idx] == "sliding_attention"
        self.window = getattr(config, "sliding_window", None) if sliding else None
        rope = getattr(config, "rope_parameters", None) or {}
        self.rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        self.has_sinks = isinstance(getattr(o, "sinks", None), torch.Tensor)
        # Qwen3-Next's gated attention: q_proj gives each head's query and then its output gate
        self.gated = o.q_proj.out_features == 2 * self.num_heads * self.head_dim
        # MiniMax-M2 normalizes q and k over all heads at once (weights of heads * d)
        q_norm = getattr(o, "q_norm", None)
        self.norm_all_heads = q_norm is not None and q_norm.weight.shape[0] == self.num_heads * self.head_dim != self.head_dim
        self.sinks: torch.Tensor | None = None  # [heads] float32, loaded
        self._runtime = None  # the CPU runtime, for the C++ decode path (set by load() on the CPU)
        self.triton_rope = False  # set by load(): q/k norms and RoPE in one Triton launch here

    def load(self) -> None:
        from ..kernels.triton.common import runs_on
        self._choose_backend()
        if self.has_sinks:
            self.sinks = self.weights.load(f"{self.key}.sinks", self.device, torch.float32,
                                           (self.num_heads,)).contiguous()
        self._runtime = self.run_context().cpu_runtime() if self.device.type == "cpu" and not self.triton else None
        self.triton_rope = runs_on(self.device)

    def _decode_all(self, queries, batch) -> torch.Tensor:
        """Triton: every sequence's query against its K/V history in place."""
        from ..kernels.triton.attention import decode_attention
        (q,) = queries
        k_cache, v_cache = self.context.cache.layers[self.layer_idx]
        slots, lens = batch.slot_table(k_cache.device)
        return decode_attention(q, k_cache, v_cache, slots, lens, self.scaling, window=self.window or 0,
                                out_dtype=q.dtype, sinks=self.sinks)  # (what o_proj takes: no cast after)

    def _cpp_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's K/V buffers when the C++ decode kernels can read them (float32 on the CPU,
        a runtime), else None."""
        if self._runtime is None:
            return None
        k_cache, v_cache = self.context.cache.layers[self.layer_idx]
        return (k_cache, v_cache) if k_cache.dtype == torch.float32 and k_cache.device.type == "cpu" else None

    def _attend_cached(self, queries, batch, i: int, start: int) -> torch.Tensor:
        (q,) = queries
        if self.triton:  # prefill: the causal kernel reads the history in place by slot
            from ..kernels.triton.attention import prefill_attention
            k_cache, v_cache = self.context.cache.layers[self.layer_idx]
            slots = batch.read_slots[i].to(k_cache.device, torch.int32)
            return prefill_attention(q, k_cache, v_cache, start, self.scaling, window=self.window or 0, slots=slots,
                                     sinks=self.sinks)
        caches = self._cpp_cache() if q.shape[0] == 1 else None
        if caches is not None:  # decode: the C++ kernel reads the history in place by slot
            return attend_gqa_decode(self._runtime, q[0].float(), *caches, self._seen(batch.read_slots[i]), self.scaling,
                                     self.sinks)[None]
        return super()._attend_cached(queries, batch, i, start)

    def _seen(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots of a decode step's history its query attends to: the last `window` ones in a
        sliding-window layer (the query is the last position), else all."""
        return slots[-self.window:] if self.window and slots.shape[0] > self.window else slots

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        B, S, _ = hidden_states.shape
        d = self.head_dim
        qkv = self._project_one(hidden_states) if B * S == 1 else None
        if qkv is None:
            qkv = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        gate = None
        if self.gated:  # per head: d query values, then d gate values
            both = qkv[0].view(B, S, self.num_heads, 2 * d)
            qkv = (both[..., :d], *qkv[1:])
            gate = both[..., d:].reshape(B, S, -1)
        q, k, v = (t.reshape(B, S, -1, d) for t in qkv)
        cos, sin = position_embeddings
        pairs = 2 * cos.shape[-1] == self.rotary_dim  # one factor per rotated pair (gpt-oss's tables)
        batch = self.context.batch if self.context is not None else None
        one_token_each = batch is not None and B == 1 and all(n == 1 for n in batch.q_lens)
        caches = (self._cpp_cache() if one_token_each and (pairs or cos.shape[-1] == self.rotary_dim)
                  and cos.dtype == torch.float32 else None)
        if caches is not None:  # RoPE, cache write and attention in one C++ call per sequence
            cos, sin = _full_tables(cos, sin, pairs)
            q, k = self._qk_norm(q, k)
            outs = [rope_write_attend_gqa(self._runtime, q[0, t].float(), k[0, t].float(), v[0, t].float(), cos[0, t],
                                          sin[0, t], *caches, int(batch.slots[t]), self._seen(batch.read_slots[i]),
                                          self.scaling, self.sinks)
                    for i, t, _, _ in batch.spans()]
            out = outs[0][None] if len(outs) == 1 else torch.stack(outs)
            return self.o_proj(_gated(out.to(hidden_states.dtype).reshape(B, S, -1), gate)), None
        q, k, written = self._norm_rope(q, k, cos, sin, v, pairs)  # [B, S, heads, d] as they are
        dev = self.device
        q = q.reshape(B * S, -1, d).to(dev)
        k = k.reshape(B * S, -1, d).to(dev)
        out = self._run([k, v.reshape(B * S, -1, d).to(dev)], (q,), B, S, written)  # [T, h, d]
        return self.o_proj(_gated(out.to(hidden_states.dtype).reshape(B, S, -1), gate)), None

    def _project_one(self, hidden_states: torch.Tensor):
        """q, k and v of one token in one launch (quant_linear.gemv_many, biases added in it) where
        all three are GPU linears whose weights it takes (int4, or dense fallbacks, on one device);
        else None."""
        from .linear import KTransformersLinear, _TritonLinear
        ops = []
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            op = proj.ops[proj.phase] if isinstance(proj, KTransformersLinear) else None
            if not isinstance(op, _TritonLinear) or op.weight is None:
                return None
            ops.append(op)
        dtype = ops[0].dtype
        if any(op.dtype != dtype for op in ops):
            return None
        from ..kernels.triton.quant_linear import gemv_many  # (it checks the weights' devices against x's)
        ys = gemv_many(hidden_states.reshape(1, -1), [op.weight for op in ops], dtype, [op.bias for op in ops])
        return None if ys is None else [y.view(*hidden_states.shape[:-1], -1) for y in ys]

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorms of q and k [B, S, heads, d] (MiniMax-M2's over all heads), where
        the model has them."""
        if self.norm_all_heads:
            return self.q_norm(q.flatten(-2)).view_as(q), self.k_norm(k.flatten(-2)).view_as(k)
        if hasattr(self, "q_norm"):
            return self.q_norm(q), self.k_norm(k)
        return q, k

    def _norm_rope(self, q, k, cos, sin, v, pairs: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """q/k norms and RoPE: one Triton launch for both q and k of a decode-sized step where
        Triton runs (the norms fused when they are KRMSNorms of q's dtype), else torch's ops.
        `pairs`: cos and sin hold one factor per rotated pair. Returns (q, k, written): the launch
        also stores k and v in the step's cache slots where the cache allows (_cache_write)."""
        B, S, _, d = q.shape
        width = cos.shape[-1]
        r = 2 * width if pairs else width
        if not (self.triton_rope and B * S <= TRITON_ROPE_TOKENS and q.device == cos.device == sin.device
                and cos.dim() == 3 and cos.shape[1] == S and 0 < r <= d and r % 2 == 0 and cos.shape[0] in (1, B)
                and sin.shape == cos.shape and sin.dtype == cos.dtype and q.dtype == k.dtype):
            q, k = self._qk_norm(q, k)
            return *rotate_qk(q, k, *_full_tables(cos, sin, pairs)), False
        from ..kernels.triton.norm_rope import qk_norm_rope
        # the kernel reads unit-stride rows (gpt-oss's tables can come strided); one table for
        # every row of the batch: stride 0
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
        cos, sin = cos.expand(B, S, width), sin.expand(B, S, width)
        norms = self._fusable_norms(q)
        if norms is None:
            q, k = self._qk_norm(q, k)
            norms = (None, None, (1e-6, 1e-6))
        write = self._cache_write(v, torch.promote_types(q.dtype, cos.dtype))
        return *qk_norm_rope(q, k, cos, sin, *norms, write=write, pair_tables=pairs), write is not None

    def _cache_write(self, v: torch.Tensor, dtype: torch.dtype):
        """(v, k_cache, v_cache, slots) for qk_norm_rope to store this step's keys and values in,
        when the engine's batch is set and this layer's caches (a PagedCache writing as its base
        class does) are on q's device in the RoPE output's dtype and layout; else None (the
        cache's own write runs)."""
        ctx = self.context
        batch = ctx.batch if ctx is not None else None
        B, S, kv, d = v.shape
        if (batch is None or B != 1 or S != batch.num_tokens or not isinstance(ctx.cache, PagedCache)
                or type(ctx.cache).write is not PagedCache.write):
            return None
        k_cache, v_cache = ctx.cache.layers[self.layer_idx]
        if not (k_cache.device == v_cache.device == v.device and k_cache.dtype == v_cache.dtype == dtype
                and k_cache.shape[1:] == v_cache.shape[1:] == (kv, d)
                and k_cache.is_contiguous() and v_cache.is_contiguous() and v.is_contiguous()):
            return None
        return v, k_cache, v_cache, batch.slots_on(v.device)

    def _fusable_norms(self, q: torch.Tensor):
        """(q weight, k weight, (q eps, k eps)) when both norms are KRMSNorms the RoPE kernel can run
        (weights [d] of q's dtype on q's device), (None, None, eps) without norms, else None."""
        from .layernorm import KRMSNorm
        if not hasattr(self, "q_norm"):
            return None, None, (1e-6, 1e-6)
        if self.norm_all_heads:
            return None
        qn, kn = self.q_norm, self.k_norm
        if not (isinstance(qn, KRMSNorm) and isinstance(kn, KRMSNorm) and qn.fusable and kn.fusable):
            return None
        if any(n.weight is None or n.weight.dtype != q.dtype or n.weight.device != q.device
               or n.weight.shape != (q.shape[-1],) for n in (qn, kn)):
            return None
        return qn.weight, kn.weight, (qn.eps, kn.eps)

    def _attend(self, q, k, v, start: int) -> torch.Tensor:
        """q [q, h, d], k/v [L, kv_heads, d] -> [q, h, d] (float32 math). The g = h / kv_heads
        query heads sharing a kv head are stacked as g*q rows against it (no repeated K/V)."""
        q_len, L, kv, d = q.shape[0], k.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kv
        mask = causal_mask(q_len, start, L, self.window, k.device)
        if q_len > 16 and self.sinks is None:  # prefill: heads as they are, SDPA groups them
            out = attend(q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), mask,
                         self.scaling)
            return out.transpose(0, 1)
        qg = q.float().reshape(q_len, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * q_len, d)
        if mask is not None:
            mask = mask.repeat(g, 1)  # row (j, i) of the stacked queries is query i
        sinks = None
        if self.sinks is not None:  # row (j, i) of kv head h is query head h*g + j
            sinks = self.sinks.to(qg.device).view(kv, g, 1).expand(kv, g, q_len).reshape(kv, g * q_len)
        out = attend(qg, k.float().transpose(0, 1), v.float().transpose(0, 1), mask, self.scaling, sinks)
        return out.reshape(kv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, kv * g, d)


OPERATORS.register("KDeepseekV2Attention")(KDeepseekV2Attention)
OPERATORS.register("KDeepseekV3Attention")(KDeepseekV2Attention)
for _name in ("KGQAAttention", "KQwen3MoeAttention", "KQwen2MoeAttention", "KMixtralAttention", "KLlamaAttention",
              "KGlm4MoeAttention", "KGptOssAttention", "KMiniMaxM2Attention", "KQwen3NextAttention",
              "KQwen35MoeAttention"):
    OPERATORS.register(_name)(KGQAAttention)
