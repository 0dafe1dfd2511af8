"""Operators: nn.Modules that replace Hugging Face modules (one concern per file). Importing the
package registers every operator and op under the names rule files use."""
from . import attention, experts, gate, layer, layernorm, linear, moe, rope  # noqa: F401  (they register)
from .base import BaseInjectedModule, set_phase
from .context import RunContext
from .registry import LINEAR_OPS, OPERATORS

# upstream KTransformers' other names (its "V2" / balance_serve rule files) for operators and ops here
# (its rotary operators' names: rope.UPSTREAM_NAMES)
UPSTREAM_ALIASES = {OPERATORS: {"KTransformersExpertsV2": "KTransformersExperts", "KDeepseekV3MoEV2": "KDeepseekV3MoE",
                                "KMoEGateGreedy": "KMoEGate", "KGlm4Experts": "KTransformersExperts",
                                "KQwen3MoeSparseMoeBlockV2": "KQwen3MoeSparseMoeBlock",
                                "KQwen2MoeSparseMoeBlockV2": "KQwen2MoeSparseMoeBlock",
                                "KMistralSparseMoEBlock": "KMixtralSparseMoeBlock",
                                "KQwen3MoeRMSNorm": "RMSNorm", "KQwen2MoeRMSNorm": "RMSNorm",
                                "KGlm4MoeRMSNorm": "RMSNorm", "flashinfer_attn": "KDeepseekV2Attention"},
                    LINEAR_OPS: {"VLinearMarlin": "KLinearMarlin", "KLinearCPUInfer": "KLinearCPU"}}
for _registry, _aliases in UPSTREAM_ALIASES.items():
    for _alias, _name in _aliases.items():
        _registry.register(_alias)(_registry.get(_name))

__all__ = ["BaseInjectedModule", "RunContext", "set_phase"]
