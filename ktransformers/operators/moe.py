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
        if hasattr(self, "shared_experts"):  # DeepSeek
            return self.shared_experts(x)
        if hasattr(self, "shared_expert"):  # Qwen2-MoE, Qwen3-Next, Qwen3.5: sigmoid-gated shared expert
            return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return 0


for _name in BLOCK_NAMES:
    OPERATORS.register(_name)(KMoEBlock)
