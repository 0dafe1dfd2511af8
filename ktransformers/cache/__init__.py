"""KV caches: the paged DeepSeek-V3 latent cache, the paged GQA cache, and the hybrid models' cache
(GQA pages beside recurrent states)."""
from .paged import (
    CacheFullError,
    ForwardBatch,
    KDeepSeekV3Cache,
    KGQACache,
    PagedCache,
    Sequence,
    make_cache,
)
from .recurrent import HybridCache

__all__ = ["CacheFullError", "ForwardBatch", "HybridCache", "KDeepSeekV3Cache", "KGQACache", "PagedCache", "Sequence", "make_cache"]
