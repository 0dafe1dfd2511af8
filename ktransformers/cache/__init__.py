"""KV caches: the paged DeepSeek-V3 latent cache, the paged GQA cache, and the hybrid models' cache
(GQA pages beside recurrent states)."""
import torch

from .paged import CacheFullError, ForwardBatch, KDeepSeekV3Cache, KGQACache, PagedCache, Sequence
from .recurrent import HybridCache, linear_layers

__all__ = ["CacheFullError", "ForwardBatch", "HybridCache", "KDeepSeekV3Cache", "KGQACache", "PagedCache", "Sequence",
           "make_cache"]


def make_cache(config, cache_lens: int, page_size: int = 256, device="cpu", dtype=torch.bfloat16,
               layer_devices: list | None = None, max_seqs: int = 8) -> PagedCache:
    """The cache an architecture's attention reads: latent for MLA models, K/V and recurrent
    states (for `max_seqs` sequences at once) for hybrid ones, K/V for the rest."""
    if linear_layers(config):
        return HybridCache(config, cache_lens, page_size, device, dtype, layer_devices, max_seqs)
    if getattr(config, "kv_lora_rank", None):
        return KDeepSeekV3Cache(config, cache_lens, page_size, device, dtype, layer_devices)
    return KGQACache(config, cache_lens, page_size, device, dtype, layer_devices)
