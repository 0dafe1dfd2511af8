"""The MoE block as route -> experts -> combine, replacing HF's sparse MoE blocks.

Shapes: hidden_states [B, S, H] -> [B, S, H]; inside, x [T, H] with T = B*S.
The block keeps the original's children (gate, experts, shared expert(s)) under the same names,
so later rules still match `...mlp.gate` and `...mlp.experts`. Splitting the block this way is
where the shared experts run while the routed ones compute elsewhere (CPU experts, the GPU).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import BaseInjectedModule, adopt_children
from .registry import OPERATORS

# The rows a shared expert's one-expert C++ call takes (decode steps): a prompt's rows keep its
# linears' multi-token kernels
SHARED_CALL_MAX_TOKENS = 16

# Upstream's per-family names for the same operator; all route through this one class.
BLOCK_NAMES = ("KDeepseekV3MoE", "KDeepseekV2MoE", "KQwen3MoeSparseMoeBlock", "KQwen2MoeSparseMoeBlock",
               "KMixtralSparseMoeBlock", "KGlm4MoeMoE", "KMiniMaxM2SparseMoeBlock", "KQwen3NextSparseMoeBlock",
               "KQwen35MoeSparseMoeBlock")


class KMoEBlock(BaseInjectedModule):
    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        missing = [c for c in ("gate", "experts") if not hasattr(orig_module, c)]
        if missing:
            raise ValueError(f"{key}: {type(orig_module).__name__} is not a MoE block (no {', '.join(missing)})")
        adopt_children(self, orig_module)
        self._shared_call = None  # shared_call's (the linears' kernels it was made on, its MoEKernel, the call)

    def forward(self, hidden_states: torch.Tensor, epilogue=None) -> torch.Tensor:
        """`epilogue`: what the caller does next with the output (kernels.cuda_host.MoEEpilogue),
        for CPU experts fed from a GPU stream to do in their read-back launch; only without
        shared experts, whose sum comes after that launch."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        (_, top_k_weights, top_k_index), packed = self._route(x)
        handoff = {} if packed is None else {"packed": packed}
        if not self._has_shared():  # nothing to overlap with (and no `+ 0` launch)
            if epilogue is not None:
                handoff["epilogue"] = epilogue
            return self.experts(x, top_k_index, top_k_weights, **handoff).reshape(shape)
        submit = getattr(self.experts, "submit", None)
        if submit is None:  # HF's experts module
            return (self.experts(x, top_k_index, top_k_weights) + self._shared(x)).reshape(shape)
        wait = submit(x, top_k_index, top_k_weights, **handoff)  # CPU experts run on their threads meanwhile
        try:
            shared = self._shared(x)
        except BaseException:
            wait()  # a started CPU call is always waited for (on a GPU stream: its `done` word cleared)
            raise
        return (wait().to(x.device, x.dtype) + shared).reshape(shape)

    def _route(self, x: torch.Tensor):
        """(the gate's (logits, weights, index), the pinned inputs it stored or None). Where the
        gate can store the experts' inputs in passing and the experts are CPU experts fed from
        this GPU stream, its launch also writes x, the index and the weights into their pinned
        buffer (the hand-off's pack: one launch less a layer), which the experts are then given."""
        stage = getattr(self.experts, "stage_inputs", None)
        if stage is not None and getattr(self.gate, "stores_inputs", False) and x.is_cuda:
            pinned = stage(x)
            if pinned is not None:
                return self.gate(x, pack=pinned), pinned
        return self.gate(x), None

    def _has_shared(self) -> bool:
        return hasattr(self, "shared_experts") or hasattr(self, "shared_expert")

    def _shared(self, x: torch.Tensor) -> torch.Tensor | int:
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= SHARED_CALL_MAX_TOKENS:
            call = self.shared_call()
            if call is not None:
                return call(x.contiguous())
        if hasattr(self, "shared_experts"):  # DeepSeek
            return self.shared_experts(x)
        if hasattr(self, "shared_expert"):  # Qwen2-MoE, Qwen3-Next, Qwen3.5: sigmoid-gated shared expert
            return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return 0

    def shared_call(self):
        """The shared expert on float32 CPU rows x [T, H] (T <= SHARED_CALL_MAX_TOKENS, contiguous)
        -> [T, H] as one call of the C++ MoE with one expert, made on its linears' own bytes: gate,
        up, SiLU and down in one parallel region, where three kernel calls and torch's ops between
        them would each wake the threads and wait on cold weights. The sigmoid gate of Qwen2-MoE,
        Qwen3-Next and Qwen3.5 is the call's expert weight (DeepSeek's and GLM's: 1). None where
        the shared expert is not three bias-free float32 CPU linears (KLinearCPU) with SiLU."""
        from .linear import KLinearCPU
        gated = hasattr(self, "shared_expert")
        mlp = self.shared_expert if gated else getattr(self, "shared_experts", None)
        ops = [getattr(getattr(mlp, n, None), "ops", {}).get("generate") for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(op, KLinearCPU) and op.kernel is not None for op in ops):
            return None
        kernels = tuple(op.kernel for op in ops)
        if self._shared_call is not None and all(a is b for a, b in zip(self._shared_call[0], kernels)):
            return self._shared_call[2]  # (made on these kernels: what follows held then)
        from transformers.activations import SiLUActivation
        from ..kernels.cpu import MoEKernel
        if not (all(op.bias is None and op.dtype == torch.float32 for op in ops)
                and isinstance(getattr(mlp, "act_fn", None), (SiLUActivation, nn.SiLU))):
            return None
        gate = self.shared_expert_gate if gated else None
        if gated and not ((type(gate) is nn.Linear and gate.weight.device.type == "cpu")
                          or isinstance(getattr(gate, "ops", {}).get("generate"), KLinearCPU)):
            return None
        g, u, d = kernels
        kernel = MoEKernel(g.runtime, experts=1, top_k=1, hidden=g.in_features, intermediate=g.out_features,
                           gate=g._weight, up=u._weight, down=d._weight, max_tokens=SHARED_CALL_MAX_TOKENS,
                           name=f"{self.key}: the shared expert", tiles=False)
        moe, hidden = kernel._moe, g.in_features
        ids = torch.zeros(SHARED_CALL_MAX_TOKENS, 1, dtype=torch.int64)
        ones = torch.ones(SHARED_CALL_MAX_TOKENS, 1)

        def call(x: torch.Tensor) -> torch.Tensor:
            T = x.shape[0]
            weight = torch.sigmoid(gate(x)).float() if gated else ones[:T]
            y = torch.empty(T, hidden)
            moe.forward(T, ids.data_ptr(), weight.data_ptr(), x.data_ptr(), y.data_ptr(), 0)  # (0: float32)
            return y
        self._shared_call = (kernels, kernel, call)  # (the MoEKernel owns what its C++ MoE reads)
        return call


for _name in BLOCK_NAMES:
    OPERATORS.register(_name)(KMoEBlock)
