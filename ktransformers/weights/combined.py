"""Two weight sources as one: the routed experts from one (a GGUF, computed on by the CPU
kernels as stored) and everything else from another (e.g. DeepSeek-V3's native FP8 safetensors,
kept as FP8 on the GPU by KLinearFP8). What each source holds beyond its share is ignored."""
from __future__ import annotations

import re

from .source import WeightSource

EXPERTS = re.compile(r"\.mlp\.experts(\.|$)")


class CombinedSource(WeightSource):
    def __init__(self, dense: WeightSource, experts: WeightSource, pattern: re.Pattern = EXPERTS):
        super().__init__()
        self.dense, self.experts, self.pattern = dense, experts, pattern
        self.path = f"{dense.path} (dense) + {experts.path} (experts)"

    def _pick(self, name: str) -> WeightSource:
        return self.experts if self.pattern.search(name) else self.dense

    def _resolve(self, name: str) -> str:
        """A tied name (lm_head -> embed_tokens) where the owning source lacks it."""
        if name in self.aliases and not self._pick(name).has(name):
            return self.aliases[name]
        return name

    @property
    def unknown(self) -> list[str]:
        return [n for n in getattr(self.experts, "unknown", []) if self.pattern.search(n)]

    def keys(self) -> list[str]:
        return ([k for k in self.dense.keys() if not self.pattern.search(k)]
                + [k for k in self.experts.keys() if self.pattern.search(k)])

    def _call(self, method: str, name: str, *args):
        """`method(name, *args)` of the source that holds `name`."""
        name = self._resolve(name)
        return getattr(self._pick(name), method)(name, *args)

    def info(self, name):
        return self._call("info", name)

    def raw(self, name):
        return self._call("raw", name)

    def _load_stored(self, name, dtype=None):
        return self._call("_load_stored", name, dtype)

    def has(self, name: str) -> bool:
        return self._call("has", name)

    def load(self, name, device="cpu", dtype=None, shape=None):
        return self._call("load", name, device, dtype, shape)

    def raw_stacked(self, name):
        return self._call("raw_stacked", name)

    def fp8_blocks(self, name):
        return self._call("fp8_blocks", name)

    def stored_row_order(self, name):
        return self._call("stored_row_order", name)

    def unconsumed(self) -> list[str]:
        return sorted([n for n in self.dense.unconsumed() if not self.pattern.search(n)]
                      + [n for n in self.experts.unconsumed() if self.pattern.search(n)])
