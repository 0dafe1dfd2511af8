"""Routed experts, one concern a module:

    reference   the formula in plain torch (moe_reference, KExpertsTorch): what the others are tested against
    cpu         KExpertsCPU, the C++ kernels on the stored GGML blocks
    gpu         KExpertsGPU, the Triton fused-MoE kernel on a GPU (all experts, or the hot ones)
    layerwise   layer-wise prefill: long prompts on the GPU, experts streamed from RAM
    placement   hot experts and the bus share, with the share's cost model
    module      KTransformersExperts, the operator rule files name, dispatching to the above
"""
from .cpu import KExpertsCPU
from .gpu import KExpertsGPU
from .layerwise import LAYERWISE_GROUP_MB, LayerwisePrefill, PinnedSlots, expert_groups
from .module import (
    ExpertsOptions,
    KTransformersExperts,
    cpu_expert_kernels,
    expert_bytes_read,
    link_expert_deferral,
    link_layerwise_prefill,
    set_expert_deferral,
    set_prefill_gpu_threshold,
)
from .placement import (
    BUS_SHARE_COSTS,
    BusShareCosts,
    ExpertPlacement,
    PcieShare,
    auto_pcie_experts,
    hot_experts,
    pcie_share_size,
)
from .reference import ExpertSpec, KExpertsTorch, check_routing, moe_reference

__all__ = ["BUS_SHARE_COSTS", "BusShareCosts", "ExpertPlacement", "ExpertSpec", "ExpertsOptions", "KExpertsCPU",
           "KExpertsGPU", "KExpertsTorch", "KTransformersExperts", "LAYERWISE_GROUP_MB", "LayerwisePrefill",
           "PcieShare", "PinnedSlots", "auto_pcie_experts", "check_routing", "cpu_expert_kernels",
           "expert_bytes_read", "expert_groups", "hot_experts", "link_expert_deferral", "link_layerwise_prefill",
           "moe_reference", "pcie_share_size", "set_expert_deferral", "set_prefill_gpu_threshold"]
