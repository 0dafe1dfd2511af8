"""The lower tiers of the prefix cache: whole pages of KV (or MLA latent) entries keyed by the
tokens they hold, in CPU RAM and then on disk, least recently used first out of each.

The top tier is the KV cache itself (the server keeps finished sequences there); when one is
evicted from it, its full pages are exported here; a later prompt that starts with the same tokens
gets them imported into fresh pages and only the rest is computed.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Entry:
    tokens: tuple[int, ...]
    nbytes: int
    data: list[list[torch.Tensor]] | None = None  # in RAM
    path: Path | None = None  # on disk


def _nbytes(data) -> int:
    return sum(t.numel() * t.element_size() for layer in data for t in layer)


class PrefixStore:
    def __init__(self, ram_bytes: int = 1 << 30, disk_dir: str | os.PathLike | None = None, disk_bytes: int = 0):
        self.ram_bytes, self.disk_bytes = int(ram_bytes), int(disk_bytes)
        self.disk_dir = Path(disk_dir) if disk_dir else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._ram: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self._disk: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.hits = {"ram": 0, "disk": 0}

    @property
    def ram_used(self) -> int:
        return sum(e.nbytes for e in self._ram.values())

    @property
    def disk_used(self) -> int:
        return sum(e.nbytes for e in self._disk.values())

    def __len__(self) -> int:
        return len(self._ram) + len(self._disk)

    def put(self, tokens: list[int], data: list[list[torch.Tensor]]) -> None:
        """Keep `data` (exported pages) for the prefix `tokens`, in RAM; overflow moves to disk."""
        key = tuple(tokens)
        self._ram.pop(key, None)
        self._drop_disk(key)
        entry = Entry(key, _nbytes(data), data=data)
        if entry.nbytes > self.ram_bytes:
            self._to_disk(entry)
            return
        self._ram[key] = entry
        while self.ram_used > self.ram_bytes:
            _, old = self._ram.popitem(last=False)
            self._to_disk(old)

    def _to_disk(self, entry: Entry) -> None:
        if self.disk_dir is None or entry.nbytes > self.disk_bytes:
            return
        name = hashlib.sha256(repr(entry.tokens).encode()).hexdigest()[:32] + ".pt"
        entry.path = self.disk_dir / name
        torch.save({"tokens": list(entry.tokens), "data": entry.data}, entry.path)
        entry.data = None
        self._disk[entry.tokens] = entry
        while self.disk_used > self.disk_bytes:
            key, _ = next(iter(self._disk.items()))
            self._drop_disk(key)

    def _drop_disk(self, key) -> None:
        entry = self._disk.pop(key, None)
        if entry is not None and entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def longest(self, prompt: list[int], limit: int) -> tuple[int, Entry | None]:
        """The stored prefix of `prompt` with the most tokens (at most `limit`), and its entry."""
        best, best_entry = 0, None
        for entries in (self._ram, self._disk):
            for key, entry in entries.items():
                n = len(key)
                if best < n <= limit and tuple(prompt[:n]) == key:
                    best, best_entry = n, entry
        return best, best_entry

    def load(self, entry: Entry) -> list[list[torch.Tensor]]:
        """The entry's pages (from RAM, or read back from disk into RAM); marks it recently used."""
        if entry.data is not None:
            self._ram.move_to_end(entry.tokens)
            self.hits["ram"] += 1
            return entry.data
        saved = torch.load(entry.path, weights_only=True)
        self.hits["disk"] += 1
        self._drop_disk(entry.tokens)
        self.put(list(entry.tokens), saved["data"])
        return saved["data"]
