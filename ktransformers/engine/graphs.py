"""CUDA graphs of the decode step: per batch size, captured on first use, replayed after.

A decode step (every sequence brings one token) has the same shapes every time, so the whole
forward — embeddings, every layer's attention over the paged cache, router, shared and hot
experts on the GPU, the CPU experts (enqueued as host functions on the stream, see
kernels/cuda_host.py), final norm and lm_head — is captured once and replayed with one launch.
What changes between steps lives in static device buffers that the graph reads: token ids,
positions, the cache slots the new tokens write, and the slot table of every sequence's history
(padded to the cache's capacity; `lens` bounds what is read).

With the layers spread over several GPUs (a pipeline, see optimize/planner.py) a graph holds one
GPU's work only, so there is one graph per device segment — a run of consecutive layers on one
GPU, the first also embedding the tokens and computing the RoPE tables, the last also running the
final norm and lm_head. Between two segments' replays the hidden states and RoPE tables are
copied into the next segment's static inputs (torch orders a copy between GPUs after the
source's stream and before the destination's); each GPU holds its own copy of the step's
positions, slots and slot table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.paged import ForwardBatch
from ..operators.rope import rotary_tables
from .devices import module_device


@dataclass
class _Segment:
    device: torch.device
    layers: range
    first: bool
    last: bool
    graphs: dict = field(default_factory=dict)  # batch size -> (graph, static inputs, outputs, host calls)
    pool: tuple | None = None
    stream: torch.cuda.Stream | None = None


def segments_of(layer_devices: list[torch.device]) -> list[tuple[torch.device, range]]:
    """Runs of consecutive layers on one device, in order."""
    runs, start = [], 0
    for i in range(1, len(layer_devices) + 1):
        if i == len(layer_devices) or layer_devices[i] != layer_devices[start]:
            runs.append((layer_devices[start], range(start, i)))
            start = i
    return runs


def unsupported(engine) -> str | None:
    """Why the engine's decode step cannot be captured, or None."""
    devices = engine.layer_devices
    if any(d.type != "cuda" for d in devices):
        return "every layer's attention must be on a GPU"
    base = engine.model.model
    if engine.embed.weight.device != devices[0]:
        return f"the embeddings ({engine.embed.weight.device}) must be on the first layer's GPU ({devices[0]})"
    for name, module in (("final norm", base.norm), ("lm_head", engine.model.lm_head)):
        device = module_device(module, devices[-1])
        if device != devices[-1]:
            return f"the {name} ({device}) must be on the last layer's GPU ({devices[-1]})"
    return None


class DecodeGraphs:
    def __init__(self, engine, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        reason = unsupported(engine)
        if reason is not None:
            raise ValueError(f"CUDA graphs of the decode step: {reason}")
        self.engine, self.max_batch = engine, max_batch
        runs = segments_of(engine.layer_devices)
        self.segments = [_Segment(d, r, k == 0, k == len(runs) - 1) for k, (d, r) in enumerate(runs)]
        cap = engine.cache.capacity
        # The step's small inputs, per device, in one buffer so that one copy from pinned host
        # memory fills them: token ids, positions, new slots and a hybrid model's recurrent-state
        # rows read and written (int64: index_copy_ wants them so), then the lengths (int32, as
        # the attention kernels read them).
        self._bytes = max_batch * (5 * 8 + 4)
        self.static = {}  # device -> the step's ids, positions, new slots, slot table and lengths there
        for device in dict.fromkeys(d for d, _ in runs):
            small = torch.zeros(self._bytes, dtype=torch.uint8, device=device)
            self.static[device] = dict(small=small, **self._views(small, max_batch),
                                       table=torch.zeros(max_batch, cap, dtype=torch.int32, device=device))
            self.static[device]["lens"].fill_(1)
        self.ids = self.static[runs[0][0]]["ids"]
        pinned = torch.cuda.is_available()
        self._host = [torch.zeros(self._bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._host_views = [{k: v.numpy() for k, v in self._views(h, max_batch).items()} for h in self._host]
        # which host buffer the next step fills; a buffer is written again only once the copy
        # that read it is done (its event: Engine.decode_tokens leaves steps in flight)
        self._flip = 0
        self._copied = [{d: torch.cuda.Event() for d in self.static} for _ in range(2)]  # per host buffer:
        # an event a device after the copy that read it (recorded again each fill)
        self._rows: list[list[int]] = [[] for _ in range(max_batch)]  # pages whose slots each table row holds

    @staticmethod
    def _views(small: torch.Tensor, n: int) -> dict:
        longs = small[:40 * n].view(torch.int64).view(5, n)
        return dict(ids=longs[0], positions=longs[1], slots=longs[2], state_read=longs[3], state_write=longs[4],
                    lens=small[40 * n:].view(torch.int32))

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured so far."""
        return sorted(self.segments[0].graphs)

    def _fill(self, batch: ForwardBatch, tokens: list[int]) -> None:
        """The step's inputs into the static buffers: the small ones written on the host into a
        pinned buffer and copied with one launch a device; a slot-table row only where its
        sequence has gained pages since the row was written (a row holds the slots of whole
        pages, `lens` bounds what is read), else nothing."""
        cache = self.engine.cache
        B, page = len(tokens), cache.page_size
        for event in self._copied[self._flip].values():
            event.synchronize()  # (at once for an event not yet recorded)
        host = self._host_views[self._flip]
        host["ids"][:B] = tokens
        if batch.state_read is not None:  # (a decode step never starts a sequence: no fresh states)
            if any(batch.state_fresh):
                raise ValueError("a decode step of a hybrid model needs every sequence's states (prefill first)")
            host["state_read"][:B], host["state_write"][:B] = batch.state_read, batch.state_write
        for b, (seq, start) in enumerate(zip(batch.seqs, batch.starts)):
            host["positions"][b] = start
            host["slots"][b] = cache.slot(seq, start)
            host["lens"][b] = start + 1
            held = self._rows[b]
            fresh = 0 if seq.pages[:len(held)] != held else len(held)  # pages already in the row
            if fresh < len(seq.pages):
                lo, hi = fresh * page, len(seq.pages) * page
                for s in self.static.values():
                    s["table"][b, lo:hi].copy_(seq.slots[lo:hi], non_blocking=True)
                self._rows[b] = list(seq.pages)
        src = self._host[self._flip]
        events = self._copied[self._flip]
        self._flip ^= 1
        for device, s in self.static.items():
            s["small"].copy_(src, non_blocking=True)
            events[device].record(torch.cuda.current_stream(device))

    def _static_batch(self, batch: ForwardBatch, B: int) -> ForwardBatch:
        """The step as the attention operators see it, every tensor a static buffer."""
        first = self.static[self.segments[0].device]
        static = ForwardBatch(batch.seqs, [1] * B, batch.starts, first["positions"][:B], first["slots"][:B],
                              batch.read_slots)
        static._tables["table"] = (first["table"][:B], first["lens"][:B])
        for device, s in self.static.items():
            static._tables[("table", str(device))] = (s["table"][:B], s["lens"][:B])
            static._tables[("slots", str(device))] = s["slots"][:B]
            static._tables[("states", str(device))] = (s["state_read"][:B], s["state_write"][:B])
        if batch.state_read is not None:
            static.state_read, static.state_write = batch.state_read, batch.state_write
            static.state_fresh = [False] * B
        return static

    def _forward(self, seg: _Segment, B: int, inputs: tuple) -> tuple:
        """One segment's share of the step: (hidden, cos, sin) for the next, or the logits."""
        engine, base = self.engine, self.engine.model.model
        positions = self.static[seg.device]["positions"][:B][None]
        if seg.first:
            hidden = base.embed_tokens(self.ids[:B][None])
            rope = rotary_tables(base.rotary_emb, hidden, positions)
        else:
            hidden, rope = inputs[0], tuple(inputs[1:])
        with torch.cuda.device(seg.device):
            hidden = engine.run_layers(hidden, positions, rope, seg.layers)
            if seg.last:
                return (engine.model.lm_head(base.norm(hidden)[0]).float(),)
        return (hidden, *rope)

    def _take_host_calls(self) -> list:
        staging = self.engine.context.staging
        if staging is None:
            return []
        calls = list(staging.used)
        staging.used.clear()
        return calls

    def _capture(self, batch: ForwardBatch, B: int) -> None:
        engine = self.engine
        engine.context.batch = self._static_batch(batch, B)
        try:
            # warm-up, eager, on side streams: compiles the Triton kernels, sizes the pinned
            # staging buffers, and gives each later segment real inputs to allocate its own from
            inputs: list[tuple] = []
            out = ()
            for seg in self.segments:
                with torch.cuda.device(seg.device):
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        inputs.append(tuple(t.to(seg.device, copy=True) for t in out))
                        out = self._forward(seg, B, inputs[-1])
                    torch.cuda.current_stream().wait_stream(side)
            for seg in self.segments:
                torch.cuda.synchronize(seg.device)
            engine.context.check_host_errors()
            self._take_host_calls()
            for seg, static_in in zip(self.segments, inputs):
                with torch.cuda.device(seg.device):
                    graph = torch.cuda.CUDAGraph()
                    seg.stream = seg.stream or torch.cuda.Stream()  # (torch's default capture stream is GPU 0's)
                    with torch.cuda.graph(graph, pool=seg.pool, stream=seg.stream):
                        outputs = self._forward(seg, B, static_in)
                    seg.pool = graph.pool()
                seg.graphs[B] = (graph, static_in, outputs, self._take_host_calls())
        finally:
            engine.context.batch = None

    def run_ahead(self, batch: ForwardBatch, tokens) -> tuple[torch.Tensor, list]:
        """A decode step whose inputs are `tokens`, host ints or a GPU tensor [B] (the previous
        step's picks, which the host has not read): replayed without waiting. Returns the graph's
        logits [B, V] (valid until its next replay: read them on the same stream before that) and
        the step's CPU-expert host calls (for HostStaging.check_calls once the step is done; not
        added to `used`, which another step in flight would empty)."""
        if len(self.segments) != 1:
            raise ValueError("decoding ahead needs the whole step on one GPU")
        B = len(batch.seqs)
        if isinstance(tokens, torch.Tensor):
            if tokens.numel() != B:
                raise ValueError(f"run_ahead: {tokens.numel()} token(s) on the GPU for a batch of {B}")
            return self._replay(batch, [0] * B, tokens)
        return self._replay(batch, [int(t) for t in tokens])

    def run(self, batch: ForwardBatch, tokens: list[int]) -> torch.Tensor:
        """Logits [B, V] of a decode step whose cache room `batch` has reserved."""
        logits, calls = self._replay(batch, tokens)
        staging = self.engine.context.staging
        if staging is not None:
            staging.used.extend(calls)
        return logits.clone()

    def _replay(self, batch: ForwardBatch, tokens: list[int], device_ids: torch.Tensor | None = None) -> tuple:
        """Fill the inputs (`device_ids`: the token ids on the GPU, used instead of `tokens`),
        capture on first use, replay every segment: (the graph's logits, until its next replay;
        the host calls of the CPU experts the replays ring)."""
        B = len(tokens)
        self._fill(batch, tokens)
        if device_ids is not None:
            self.ids[:B].copy_(device_ids.reshape(-1)[:B])  # (after _fill's copy on the stream)
        if B not in self.segments[0].graphs:
            self._capture(batch, B)
        staging = self.engine.context.staging
        if staging is not None:
            staging.wake()  # CPU experts rung from the graph: their doorbell spins from now
        previous, host_calls = (), []
        for seg in self.segments:
            graph, static_in, outputs, calls = seg.graphs[B]
            with torch.cuda.device(seg.device):
                for dst, src in zip(static_in, previous):
                    dst.copy_(src)
                graph.replay()
            host_calls.extend(calls)
            previous = outputs
        return previous[0], host_calls
