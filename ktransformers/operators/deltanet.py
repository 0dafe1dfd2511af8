"""KGatedDeltaNet: the gated DeltaNet (linear attention) layer of Qwen3-Next and Qwen3.5-MoE,
over the recurrent states of cache.recurrent.HybridCache.

Per token: in_proj_qkvz gives q, k [Hk, Dk], v [Hv, Dv] and the output gate z [Hv, Dv];
in_proj_ba gives beta (sigmoid) and the decay g = -exp(A_log) * softplus(a + dt_bias) per value
head (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a give the same, one each). q, k
and v pass a short causal depthwise convolution (kernel K, SiLU) whose last K - 1 inputs are the
conv state; then the gated delta rule runs over the state S [Hv, Dk, Dv]:

    S = S * exp(g);  S = S + k ⊗ beta * (v - Sᵀk);  out = Sᵀq / sqrt(Dk)   (q, k L2-normed)

and the output is RMSNorm(out) * SiLU(z) through out_proj. The children (the projections,
conv1d, norm, out_proj) are transformers' own, so linear rules still match them.

Each key head serves Hv / Hk value heads. transformers orders the value heads by key head
(grouped: value head j reads key head j // (Hv / Hk)); llama.cpp's qwen35moe files order them
tiled (value head j reads key head j % Hk), in every tensor with a value-head dimension. The
operator computes in the order its weights are stored (`WeightSource.value_heads_tiled`), so
no tensor is reordered at load.

When the engine has set a ForwardBatch, the input is the step's packed tokens [1, N, H] of several
sequences: each reads its states from the batch's `state_read` rows (zeros where
`state_fresh`) and writes them to its `state_write` rows. With no batch, each row of [B, S, H]
is one sequence from zero states. On the CPU the delta rule runs on the C++ kernel, over the
cache's state rows (kernels.cpu.gated_delta_rule_rows; a decode step, conv and norm included, in one
call). On a GPU a decode step runs in one Triton launch from the projections' rows to the gated norm
(kernels.triton.deltanet), and prompts on flash-linear-attention's kernels where that package is
installed, else on transformers' own torch functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseInjectedModule, adopt_children
from .registry import OPERATORS


def _hf_functions():
    """transformers' own torch functions, unwrapped: its wrappers may hand them to
    flash-linear-attention where that is installed, whatever the inputs' device."""
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return inspect.unwrap(m.torch_chunk_gated_delta_rule), inspect.unwrap(m.torch_recurrent_gated_delta_rule)


def delta_rule_torch(q, k, v, g, beta, state):
    """The gated delta rule by transformers' torch functions: q, k [n, T, Hk, Dk], v [n, T, Hv, Dv],
    g, beta [n, T, Hv], state [n, Hv, Dk, Dv] float32 -> (out [n, T, Hv, Dv] float32, the final
    state). Key heads are repeated for the value heads they serve first (as transformers does)."""
    chunk, recurrent = _hf_functions()
    r = v.shape[2] // q.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    fn = recurrent if q.shape[1] == 1 else chunk
    out, final = fn(q.float(), k.float(), v.float(), g=g.float(), beta=beta.float(), initial_state=state,
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out.float(), final.float()


def fla_available() -> bool:
    """Whether flash-linear-attention's Triton kernels can be imported (the GPU's fast path)."""
    global _FLA
    if _FLA is None:
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
            _FLA = True
        except Exception:  # (not installed, or its Triton cannot build here)
            _FLA = False
    return _FLA


_FLA: bool | None = None


def delta_rule_fla(q, k, v, g, beta, state):
    """delta_rule_torch's contract by flash-linear-attention's kernels: the chunked one for a
    prompt, the fused recurrent one for one token (both take grouped value heads as they are)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    fn = fused_recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
    out, final = fn(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g=g.float().contiguous(),
                    beta=beta.float().contiguous(), initial_state=state.contiguous(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return out.float(), final.float()


class KGatedDeltaNet(BaseInjectedModule):
    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        # Qwen3-Next fuses the projections in two, Qwen3.5 keeps four
        self.fused = hasattr(orig_module, "in_proj_qkvz")
        projections = ("in_proj_qkvz", "in_proj_ba") if self.fused else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                         "in_proj_a")
        missing = [c for c in (*projections, "conv1d", "norm", "out_proj") if not hasattr(orig_module, c)]
        if missing:
            raise ValueError(f"{key}: {type(orig_module).__name__} is not a gated DeltaNet layer "
                             f"(no {', '.join(missing)})")
        adopt_children(self, orig_module)
        o = orig_module
        self.layer_idx = o.layer_idx
        self.Hk, self.Hv, self.Dk, self.Dv = o.num_k_heads, o.num_v_heads, o.head_k_dim, o.head_v_dim
        if self.Hv % self.Hk:
            raise ValueError(f"{key}: value heads ({self.Hv}) must be a multiple of key heads ({self.Hk})")
        self.kernel_size = o.conv_kernel_size
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # on a GPU the step's state rows come from the batch's static buffers, so CUDA graphs may
        # capture it (the engine asks every token mixer this)
        self.triton = False
        self.dt_bias: torch.Tensor | None = None  # [Hv] float32, loaded
        self.neg_A: torch.Tensor | None = None  # -exp(A_log) [Hv] float32, loaded
        self._conv_w: torch.Tensor | None = None  # [conv_dim, K] float32
        self._norm_w: torch.Tensor | None = None  # the gated norm's weight [Dv] float32
        self._runtime = None  # the CPU runtime: the C++ delta rule
        self.tiled = False  # value heads stored tiled (set by load from the weights)

    def load(self) -> None:
        dev = self.device
        self.dt_bias = self.weights.load(f"{self.key}.dt_bias", dev, torch.float32, (self.Hv,)).contiguous()
        A_log = self.weights.load(f"{self.key}.A_log", dev, torch.float32, (self.Hv,))
        self.neg_A = -A_log.exp()
        self._conv_w = self._norm_w = None
        self._runtime = self.run_context().cpu_runtime() if dev.type == "cpu" else None
        self.triton = dev.type == "cuda"
        self.tiled = bool(getattr(self.weights, "value_heads_tiled", False))

    def unload(self) -> None:
        self.dt_bias = self.neg_A = self._conv_w = self._norm_w = self._runtime = None

    def _conv_weight(self) -> torch.Tensor:
        if self._conv_w is None:
            self._conv_w = self.conv1d.weight.detach().float().reshape(self.conv_dim, self.kernel_size).contiguous()
        return self._conv_w

    # -- the layer ----------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        B, S, _ = hidden_states.shape
        batch = self.context.batch if self.context is not None else None
        if batch is not None:
            if B != 1 or S != batch.num_tokens:
                raise ValueError(f"{self.key}: a ForwardBatch of {batch.num_tokens} tokens needs hidden_states of "
                                 f"shape [1, {batch.num_tokens}, H], got {list(hidden_states.shape)}")
            if batch.state_read is None:
                raise ValueError(f"{self.key}: the engine's cache keeps no recurrent states (a HybridCache is needed)")
            if self.triton_decodes(hidden_states.device) and all(q == 1 for q in batch.q_lens):
                out = self._decode_triton(hidden_states[0], batch)
                return self.out_proj(out.reshape(B, S, self.value_dim))
        projections = self._projections(hidden_states)
        if (batch is not None and self._in_rows(hidden_states.device) and all(q == 1 for q in batch.q_lens)
                and all(p.dtype == torch.float32 for p in projections)):
            out = self._decode_cpu(tuple(p[0] for p in projections), batch)
            return self.out_proj(out.reshape(B, S, self.value_dim).to(hidden_states.dtype))
        mixed, z, beta, g = self._split(B, S, *projections)
        if batch is None:  # no cache: each row one sequence from zero states
            outs = [self._sequence(mixed[b], beta[b], g[b], None, None) for b in range(B)]
            out = torch.stack(outs)
        else:
            out = self._batch(mixed[0], beta[0], g[0], batch)[None]
        out = self.norm(out.to(hidden_states.dtype).reshape(-1, self.Dv), z.reshape(-1, self.Dv))
        return self.out_proj(out.reshape(B, S, self.value_dim))

    def _projection_names(self) -> tuple[str, ...]:
        return ("in_proj_qkvz", "in_proj_ba") if self.fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n)(x) for n in self._projection_names())

    def _split(self, B: int, S: int, *projections):
        """The input projections' outputs -> (q, k and v side by side, z, beta, g). Qwen3-Next's
        layout of the fused projections: per key head, its q, k, then the v and z of the value
        heads it serves; per key head, their b then their a."""
        if self.fused:
            qkvz, ba = projections
            r = self.Hv // self.Hk
            qkvz = qkvz.view(B, S, self.Hk, 2 * self.Dk + 2 * r * self.Dv)
            q, k, v, z = torch.split(qkvz, [self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=-1)
            b, a = torch.split(ba.view(B, S, self.Hk, 2 * r), [r, r], dim=-1)
            mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], dim=-1)
        else:
            mixed, z, b, a = projections
            mixed = mixed.reshape(B, S, -1)
        beta = b.reshape(B, S, self.Hv).float().sigmoid()
        g = self.neg_A.to(a.device) * F.softplus(a.reshape(B, S, self.Hv).float() + self.dt_bias.to(a.device))
        return mixed, z.reshape(B, S, self.Hv, self.Dv), beta, g

    def cpu_step(self):
        """One token of one sequence on the C++ kernels, without the projections' module calls:
        a function h [1, H] float32 (contiguous) -> [1, H], or None where the step does not fit
        (several sequences or tokens in the step's batch); None instead of the function where this
        layer does not decode so (not on the CPU kernels, a projection that is not a CPU linear).
        The same kernels on the same inputs as forward's, so the same result to the bit."""
        from .linear import direct_call
        if self._runtime is None:
            return None
        projections = [direct_call(getattr(self, n)) for n in self._projection_names()]
        out = direct_call(self.out_proj)
        if None in projections or out is None:
            return None

        def step(h: torch.Tensor) -> torch.Tensor | None:
            batch = self.context.batch if self.context is not None else None
            if batch is None or batch.state_read is None or batch.num_tokens != 1:
                return None
            return out(self._decode_cpu(tuple(p(h) for p in projections), batch))
        return step

    def _batch(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, batch) -> torch.Tensor:
        """The step's packed tokens [N, ...] -> [N, Hv, Dv] float32, each sequence from its states.
        On the CPU the kernel reads and writes the delta-rule states in their rows of the cache
        (no copy of them here); elsewhere they are gathered, computed on, and put back."""
        cache = self.context.cache
        conv, ssm = cache.conv[self.layer_idx], cache.ssm[self.layer_idx]
        dev = conv.device
        reads, writes = batch.state_rows(dev)
        fresh = [i for i, f in enumerate(batch.state_fresh) if f]
        conv_in = conv.index_select(0, reads)
        if self._in_rows(dev):
            ssm_in = torch.tensor([-1 if f else r for r, f in zip(batch.state_read, batch.state_fresh)])
        else:
            ssm_in = ssm.index_select(0, reads)
            if fresh:
                ssm_in[fresh] = 0
        if fresh:  # (never in a CUDA-graph step: decode steps follow a prefill)
            conv_in[fresh] = 0
        if all(q == 1 for q in batch.q_lens):  # decode: every sequence at once
            x, conv_out = self._conv_step(mixed.to(dev), conv_in)
            out = self._delta(x[:, None], beta.to(dev)[:, None], g.to(dev)[:, None], ssm, ssm_in, writes)
            conv.index_copy_(0, writes, conv_out)
            return out[:, 0]
        outs = []
        for i, first, q_len, _ in batch.spans():
            rows = slice(first, first + q_len)
            outs.append(self._sequence(mixed[rows].to(dev), beta[rows].to(dev), g[rows].to(dev), conv_in[i:i + 1],
                                       (conv, ssm, ssm_in[i:i + 1], writes[i:i + 1])))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def triton_decodes(self, device: torch.device) -> bool:
        """Whether a decode step on `device` runs the one-launch Triton kernel (on a GPU)."""
        from ..kernels.triton.common import runs_on
        return device.type == "cuda" and self._runtime is None and runs_on(device)

    def _decode_triton(self, x: torch.Tensor, batch) -> torch.Tensor:
        """One token of each sequence, x [N, H] -> the gated norm's output [N, Hv * Dv], by
        kernels.triton.deltanet from the projections' rows over the cache's state rows."""
        from ..kernels.triton.deltanet import gated_delta_decode
        conv, ssm, reads, writes = self._decode_rows(batch)
        if self.fused:
            projections = (self.in_proj_qkvz(x), self.in_proj_ba(x))
        else:
            projections = (self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x))
        return gated_delta_decode(projections, conv, self._conv_weight(), ssm, reads, writes, self.neg_A, self.dt_bias,
                                  self.norm.weight.detach(), self.norm.variance_epsilon, (self.Hk, self.Hv, self.Dk, self.Dv),
                                  self.tiled)

    def _decode_rows(self, batch):
        """(this layer's conv and delta-rule state tables, the rows a decode step reads, -1 where a
        sequence starts fresh, and the rows it writes), for the one-call decode kernels."""
        cache = self.context.cache
        conv, ssm = cache.conv[self.layer_idx], cache.ssm[self.layer_idx]
        reads, writes = batch.state_rows(conv.device)
        if any(batch.state_fresh):  # (never in a CUDA-graph step: decode steps follow a prefill)
            reads = torch.where(torch.tensor(batch.state_fresh, device=conv.device), -1, reads)
        return conv, ssm, reads, writes

    def _decode_cpu(self, projections: tuple[torch.Tensor, ...], batch) -> torch.Tensor:
        """A decode step on the CPU from the projections' float32 rows [N, ...]: beta and g, the conv
        step, the delta rule and the gated norm in one C++ call over the cache's state rows ->
        [N, Hv * Dv] float32."""
        from ..kernels.cpu import gated_delta_decode
        conv, ssm, reads, writes = self._decode_rows(batch)
        if self._norm_w is None:
            self._norm_w = self.norm.weight.detach().float().contiguous()
        return gated_delta_decode(self._runtime, projections, conv, self._conv_weight(), ssm, reads, writes, self.neg_A,
                                  self.dt_bias, self._norm_w, self.norm.variance_epsilon,
                                  (self.Hk, self.Hv, self.Dk, self.Dv), self.tiled)

    def _in_rows(self, device: torch.device) -> bool:
        """Whether the delta rule runs on the C++ kernel over the cache's state rows."""
        return self._runtime is not None and device.type == "cpu"

    def _sequence(self, mixed, beta, g, conv_in, store) -> torch.Tensor:
        """One sequence's T tokens [T, ...] from its conv state conv_in [1, C, K-1] (None: zeros)
        and, with `store` = (conv, ssm, its delta-rule state or row, its row to write), from and
        into the cache's states (else from zero states, into none) -> [T, Hv, Dv]."""
        T = mixed.shape[0]
        if conv_in is None:
            conv_in = torch.zeros(1, self.conv_dim, self.kernel_size - 1, device=mixed.device)
        window = torch.cat([conv_in[0], mixed.float().t()], dim=1)  # [C, K-1+T]
        x = F.silu(F.conv1d(window[None], self._conv_weight()[:, None], groups=self.conv_dim)[0]).t()  # [T, C]
        x = x.to(mixed.dtype)  # (rounded as transformers rounds the conv's output)
        if store is None:
            zeros = torch.zeros(1, self.Hv, self.Dk, self.Dv, device=mixed.device)
            return self._delta(x[None], beta[None], g[None], zeros, zeros, None)[0]
        conv, ssm, ssm_in, row = store
        out = self._delta(x[None], beta[None], g[None], ssm, ssm_in, row)
        conv.index_copy_(0, row, window[None, :, T:])
        return out[0]

    def _conv_step(self, x: torch.Tensor, conv_in: torch.Tensor):
        """One token of n sequences: x [n, C], conv_in [n, C, K-1] -> (SiLU(conv) [n, C] in x's dtype,
        the new conv states)."""
        w, xf = self._conv_weight(), x.float()
        y = F.silu(torch.addcmul((conv_in * w[:, :-1]).sum(dim=-1), xf, w[:, -1]))
        return y.to(x.dtype), torch.cat([conv_in[:, :, 1:], xf[:, :, None]], dim=2)  # (contiguous: a cheap store)

    def _delta(self, x: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, ssm: torch.Tensor, ssm_in: torch.Tensor,
               rows: torch.Tensor | None) -> torch.Tensor:
        """x [n, T, C] (q, k, v after the conv), beta, g [n, T, Hv] -> out [n, T, Hv, Dv] float32.
        The states: where the C++ kernel runs on the cache's rows, ssm_in holds each sequence's row
        to read (-1: zeros) and `rows` those to write in `ssm`; else ssm_in holds the states
        themselves [n, Hv, Dk, Dv] and the final ones go to `rows` of `ssm` (None: nowhere)."""
        n, T, _ = x.shape
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, T, self.Hk, self.Dk), k.reshape(n, T, self.Hk, self.Dk)
        v = v.reshape(n, T, self.Hv, self.Dv)
        if self.tiled and self.Hv != self.Hk:  # value head j reads key head j % Hk: give each its own
            q, k = q.repeat(1, 1, self.Hv // self.Hk, 1), k.repeat(1, 1, self.Hv // self.Hk, 1)
        if rows is not None and self._in_rows(x.device):
            from ..kernels.cpu import gated_delta_rule_rows
            return gated_delta_rule_rows(self._runtime, *(t.float().contiguous() for t in (q, k, v, g, beta)), ssm,
                                         ssm_in, rows.contiguous())
        if self._runtime is not None and x.device.type == "cpu":
            from ..kernels.cpu import gated_delta_rule
            state = ssm_in.clone()
            out = gated_delta_rule(self._runtime, *(t.float().contiguous() for t in (q, k, v, g, beta)), state)
        elif x.device.type == "cuda" and fla_available():
            out, state = delta_rule_fla(q, k, v, g, beta, ssm_in)
        else:
            out, state = delta_rule_torch(q, k, v, g, beta, ssm_in)
        if rows is not None:
            ssm.index_copy_(0, rows, state)
        return out


OPERATORS.register("KGatedDeltaNet")(KGatedDeltaNet)
OPERATORS.register("KQwen3NextGatedDeltaNet")(KGatedDeltaNet)
OPERATORS.register("KQwen35MoeGatedDeltaNet")(KGatedDeltaNet)
