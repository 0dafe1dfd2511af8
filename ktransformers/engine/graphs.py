"""CUDA graphs of the decode step: one graph per batch size, captured on first use, replayed after.

A decode step (every sequence brings one token) has the same shapes every time, so the whole
forward — embeddings, every layer's attention over the paged cache, router, shared and hot
experts on the GPU, the CPU experts (enqueued as host functions on the stream, see
kernels/cuda_host.py), final norm and lm_head — is captured once and replayed with one launch.
What changes between steps lives in static device buffers that the graph reads: token ids,
positions, the cache slots the new tokens write, and the slot table of every sequence's history
(padded to the cache's capacity; `lens` bounds what is read).
"""
from __future__ import annotations

import torch

from ..cache.paged import ForwardBatch


class DecodeGraphs:
    def __init__(self, engine, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        cache = engine.cache
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the cache on a CUDA device, not {cache.device}")
        self.engine, self.max_batch = engine, max_batch
        dev, cap = cache.device, cache.capacity
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.table = torch.zeros(max_batch, cap, dtype=torch.int32, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self.pool = None

    def _fill(self, batch: ForwardBatch, tokens: list[int]) -> None:
        B = len(tokens)
        table, lens = batch.slot_table(self.table.device)  # columns past `width` stay stale: lens bounds reads
        self.ids[:B].copy_(torch.tensor(tokens), non_blocking=True)
        self.positions[:B].copy_(batch.positions, non_blocking=True)
        self.slots[:B].copy_(batch.slots, non_blocking=True)
        self.table[:B, :table.shape[1]].copy_(table)
        self.lens[:B].copy_(lens)

    def _forward(self, batch: ForwardBatch, B: int) -> torch.Tensor:
        static = ForwardBatch(batch.seqs, [1] * B, batch.starts, self.positions[:B], self.slots[:B], batch.read_slots)
        static._tables["table"] = (self.table[:B], self.lens[:B])
        engine = self.engine
        engine.context.batch = static
        try:
            hidden = engine._decoder(self.ids[:B][None], self.positions[:B][None])
        finally:
            engine.context.batch = None
        return engine.model.lm_head(hidden[0]).float()

    def _capture(self, batch: ForwardBatch, B: int) -> None:
        # warm-up on a side stream: compiles the Triton kernels, sizes the pinned staging buffers
        side = torch.cuda.Stream(device=self.engine.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(batch, B)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.engine.context.check_host_errors()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(batch, B)
        self.pool = graph.pool()
        staging = self.engine.context._staging
        calls = list(staging.used) if staging is not None else []
        if staging is not None:
            staging.used.clear()
        self.graphs[B] = (graph, logits, calls)

    def run(self, batch: ForwardBatch, tokens: list[int]) -> torch.Tensor:
        """Logits [B, V] of a decode step whose cache room `batch` has reserved."""
        B = len(tokens)
        self._fill(batch, tokens)
        if B not in self.graphs:
            self._capture(batch, B)
        graph, logits, calls = self.graphs[B]
        graph.replay()
        staging = self.engine.context._staging
        if staging is not None:
            staging.used.extend(calls)
        return logits.clone()
