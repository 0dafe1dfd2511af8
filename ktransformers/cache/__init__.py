"""KV caches: the paged DeepSeek-V3 latent cache and the paged GQA cache."""
from .paged import (
    CacheFullError,
    ForwardBatch,
    KDeepSeekV3Cache,
    KGQACache,
    PagedCache,
    Sequence,
    make_cache,
)

__all__ = ["CacheFullError", "ForwardBatch", "KDeepSeekV3Cache", "KGQACache", "PagedCache", "Sequence", "make_cache"]
