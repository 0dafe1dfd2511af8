"""Continuous batching: requests join and leave the running batch at step boundaries.

One thread owns the engine. Each iteration it
  1. drops cancelled requests (their cache pages are freed) and admits waiting ones up to
     `max_batch` (a request whose prompt shares a prefix with a finished one takes over that
     sequence's cache: the prefix cache),
  2. computes one prefill chunk of one request still reading its prompt (so a long prompt
     does not stall the others: decode steps go on between its chunks),
  3. runs one decode step for every other running request at once (one forward: the CPU experts
     see every token of the step together), each one's next token picked on the logits' device.
On one GPU with CUDA graphs the decode steps run ahead, as Engine.decode_tokens does: while the
batch stays the same, step n+1 is enqueued on the GPU's picks of step n before the host reads
them, so neither the GPU nor the CPU experts wait for Python (streaming the text, HTTP) between
steps. Anything that changes the batch (a newcomer's prompt, a cancellation) first waits for the
step in flight. Text reaches each request's asyncio queue through its event loop (thread-safe).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from ..cache.paged import CacheFullError, Sequence
from ..engine.generate import common_prefix, eos_token_ids
from ..engine.grammar import mask_rows
from ..engine.sampling import NOTHING_TO_DRAW, Sampler, SamplingParams
from ..engine.streaming import StopMatcher, StreamDecoder
from ..operators.experts import cpu_expert_kernels, expert_bytes_read


def _put_all(events) -> None:
    for q, event in events:
        q.put_nowait(event)


def _emit_channels(r: "Request", pieces) -> None:
    """A harmony answer's pieces as events: the final channel is text, a message to a function
    ("functions.NAME") a tool call's arguments, the others reasoning."""
    for piece in pieces:
        if (piece.recipient or "").startswith("functions."):
            r.emit("tool", (piece.recipient.removeprefix("functions."), piece.text))
        else:
            r.emit("text" if piece.channel == "final" else "reasoning", piece.text)


@dataclass
class EngineStats:
    """What the scheduler's engine computed, summed since start: decode steps, the tokens they
    decoded (one a running request each) and the seconds spent in them; prefill chunks alike.
    `decode_tokens / decode_s` is the engine's own decode rate, to compare with what clients see.
    `expert_bytes`: the expert weights the CPU experts have streamed (Scheduler.engine_stats fills
    it in; an expert once a call however many tokens of the step share it), `prefill_expert_bytes`
    the part of them read by prefill chunks: the rest over a stream rate is decode's floor."""
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    preemptions: int = 0
    expert_bytes: int = 0
    prefill_expert_bytes: int = 0


class QueueFull(RuntimeError):
    """More requests are waiting than the scheduler accepts (HTTP 429)."""


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation request and its progress. Events put on `events` (in `loop`):
    ("text", str) and, for a harmony model's chat, ("reasoning", str) (its analysis channel) and
    ("tool", (function name, arguments text)), then ("done", finish_reason) or ("error", message)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens tokens whatever the model says (benchmarks)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    harmony: object | None = None  # engine.harmony.HarmonyChat: its parser splits the answer into channels
    stop_ids: frozenset = frozenset()  # tokens that end the answer besides the model's EOS
    grammar: object | None = None  # engine.grammar.Constraint: masks each draw (structured output)
    keep_special: bool = False  # the text keeps special tokens (tool-call and reasoning markers)
    stop_hit: str | None = None  # the stop string that ended the answer, if one did
    api: str = "other"  # the API it came through (openai, anthropic, ollama): the metrics' label
    # progress, owned by the scheduler thread
    seq: Sequence | None = None
    begin: int | None = None  # next prompt position to compute; None once the prompt is in
    next_token: int | None = None  # sampled, not yet fed
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    finish_reason: str | None = None
    preempted: int = 0  # times its cache was given up for others' (it resumes from its tokens so far)
    ids: list[int] = field(default_factory=list)  # the tokens its prefill computes: the prompt, and
    # after a preemption the answer so far too (its last token is then the next input)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None

    outbox: list | None = field(default=None, repr=False)  # the scheduler's, delivered once per iteration

    def emit(self, kind: str, payload) -> None:
        if self.loop is None or self.events is None:
            return
        if self.outbox is not None:
            self.outbox.append((self, (kind, payload)))
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.cancelled = True


class PrefixPool:
    """Finished sequences kept with their cache, least recently used first: a new prompt that
    shares a prefix with one takes it over (the engine recomputes only the rest). With a
    PrefixStore, a sequence evicted from the cache leaves its full pages in RAM (then on disk),
    and a prompt starting with their tokens gets them back in fresh pages."""

    def __init__(self, engine, max_seqs: int = 32, store=None):
        self.engine, self.max_seqs, self.store = engine, max_seqs, store
        self._seqs: OrderedDict[int, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def take(self, prompt_ids: list[int]) -> Sequence | None:
        best, best_len = None, 0
        for seq in self._seqs.values():
            n = common_prefix(self.engine.cached_tokens(seq), prompt_ids)
            if n > best_len:
                best, best_len = seq, n
        if self.store is not None:
            restored = self._restore(prompt_ids, best_len)
            if restored is not None:
                return restored
        if best is not None and self._seqs.pop(best.seq_id, None) is None:
            return None  # (evicted while making room for a restore that did not happen)
        return best

    def _restore(self, prompt_ids: list[int], better_than: int) -> Sequence | None:
        """A fresh sequence filled from the store's longest prefix of the prompt, when that beats
        what the cache itself holds."""
        n, entry = self.store.longest(prompt_ids, len(prompt_ids) - 1)
        if entry is None or n <= better_than:
            return None
        cache = self.engine.cache
        data = self.store.load(entry)  # before evicting: eviction may push this very entry out of RAM
        need = n // cache.page_size
        while len(cache._free) < need and self.evict_one():
            pass
        if len(cache._free) < need:
            return None
        seq = self.engine.new_sequence()
        try:
            cache.import_pages(seq, data)
        except Exception:  # (a stored entry that does not fit this cache): compute the prompt instead
            self.engine.release(seq)
            return None
        self.engine.adopt(seq, prompt_ids[:n])
        return seq

    def put(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        while len(self._seqs) > self.max_seqs:
            self.evict_one()

    def evict_one(self) -> bool:
        if not self._seqs:
            return False
        _, seq = self._seqs.popitem(last=False)
        self.store_and_release(seq)
        return True

    def store_and_release(self, seq: Sequence) -> None:
        """Give `seq`'s pages back to the cache, its full pages kept a tier down (with a store)."""
        self._seqs.pop(seq.seq_id, None)
        if self.store is not None:  # its full pages go down a tier
            tokens = self.engine.cached_tokens(seq)
            pages = min(len(tokens) // self.engine.cache.page_size, len(seq.pages))
            if pages:
                self.store.put(tokens[:pages * self.engine.cache.page_size], self.engine.cache.export_pages(seq, pages))
        self.engine.release(seq)

    def clear(self) -> None:
        while self.evict_one():
            pass


class Scheduler:
    def __init__(self, engine, tokenizer, max_batch: int = 8, max_queue: int = 64, prefix_cache: bool = True,
                 prefix_cache_seqs: int = 32, prefix_store=None, run_ahead: bool | None = None):
        """`run_ahead`: keep a decode step in flight while the batch stays the same (default: where
        the engine enqueues steps without waiting for them, Engine.decodes_ahead)."""
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be positive")
        seqs = getattr(engine.cache, "max_seqs", max_batch)
        if seqs < max_batch:
            raise ValueError(f"the engine's cache keeps recurrent states for {seqs} sequences, fewer than max_batch "
                             f"({max_batch}): make the Engine with max_batch >= {max_batch}")
        self.engine, self.tokenizer = engine, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        # (a hybrid model's pages hold no recurrent states: its prefixes are not reused)
        prefix_cache = prefix_cache and engine.cache.reuses_prefixes
        self.pool = PrefixPool(engine, prefix_cache_seqs, prefix_store) if prefix_cache else None
        self.eos_ids = eos_token_ids(engine.model, tokenizer)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._outbox: list = []
        self._waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending = 0  # submitted, not yet admitted (read by the HTTP side for 429)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.stats = EngineStats()
        self._expert_kernels = cpu_expert_kernels(engine.model)
        self.on_finish: list = []  # callables given each request as it ends (metrics, the request log)
        self.run_ahead = engine.decodes_ahead() if run_ahead is None else run_ahead
        self._ahead = None  # (the decode step in flight, its requests in row order)
        self._thread = threading.Thread(target=self._loop, name="kt-scheduler", daemon=True)
        self._thread.start()

    # -- the HTTP side ---------------------------------------------------------------------
    def engine_stats(self) -> dict:
        """EngineStats now, as a dict (/health)."""
        return dataclasses.asdict(dataclasses.replace(self.stats, expert_bytes=expert_bytes_read(self._expert_kernels)))

    @property
    def context_length(self) -> int:
        return self.engine.cache.capacity

    def submit(self, request: Request) -> None:
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests are waiting (--max_queue {self.max_queue}); retry later")
            self._pending += 1
        self._inbox.put(request)
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet running."""
        return self._pending

    def free_pages(self) -> int:
        """Pages free in the cache, counting those the prefix cache holds (it gives them back on demand)."""
        held = sum(len(s.pages) for s in self.pool._seqs.values()) if self.pool is not None else 0
        return len(self.engine.cache._free) + held

    # -- the scheduler thread -------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._take_inbox()
            if not self.running and not self._waiting:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._iteration()
            except Exception as e:  # a failed step ends the requests it touched, not the server
                traceback.print_exc()
                if self._ahead is not None:  # (a step still in flight: waited for, its entries dropped)
                    step, self._ahead = self._ahead[0], None
                    self.engine.drop([step], report=False)
                for r in list(self.running):
                    self._finish(r, None, error=f"{type(e).__name__}: {e}")
            finally:
                self._deliver()

    def _deliver(self) -> None:
        """Hand the iteration's events to their event loops: one wake-up per loop, not per token."""
        if not self._outbox:
            return
        batches: dict = {}
        for r, event in self._outbox:
            batches.setdefault(r.loop, []).append((r.events, event))
        self._outbox.clear()
        for loop, events in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, events)
            except RuntimeError:  # that loop is closed (shutting down): nobody is listening
                pass

    def _take_inbox(self) -> None:
        while True:
            try:
                r = self._inbox.get_nowait()
            except queue.Empty:
                return
            r.outbox = self._outbox
            self._waiting.append(r)

    def _iteration(self) -> None:
        engine = self.engine
        cancelled = [r for r in self.running if r.cancelled]
        if cancelled:
            self._drain()
        for r in cancelled:
            self._finish(r, "cancelled")
        while self._waiting and len(self.running) < self.max_batch:
            r = self._waiting[0]
            if not r.cancelled and not self._fits(r):
                break  # it waits, first in line, until running requests give pages back
            self._waiting.popleft()
            with self._lock:
                self._pending -= 1
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            r.ids = r.prompt_ids + r.tokens  # (a preempted request resumes after its last token)
            try:  # a failure here ends this request, not the others
                r.seq = (self.pool.take(r.ids) if self.pool is not None else None) or engine.new_sequence()
                r.begin = engine.prefill_start(r.seq, r.ids)
            except Exception as e:
                if r.seq is not None:
                    engine.release(r.seq)
                    r.seq = None
                self._finish(r, None, error=str(e) if isinstance(e, (CacheFullError, ValueError))
                             else f"{type(e).__name__}: {e}")
                continue
            if not r.preempted:
                r.cached_tokens = r.begin
            self.running.append(r)
        reading = next((r for r in self.running if r.begin is not None), None)
        if reading is not None:  # one chunk of one prompt per iteration
            self._drain()
            n = min(engine.chunk_size, len(reading.ids) - reading.begin)
            if self._room_for(reading, n):
                t0, read = time.perf_counter(), expert_bytes_read(self._expert_kernels)
                logits, reading.begin = engine.prefill_chunk(reading.seq, reading.ids, reading.begin)
                self.stats.prefill_expert_bytes += expert_bytes_read(self._expert_kernels) - read
                self.stats.prefill_chunks += 1
                self.stats.prefill_tokens += n
                self.stats.prefill_s += time.perf_counter() - t0
                if reading.begin >= len(reading.ids):
                    reading.begin = None
                    reading.t_first = reading.t_first or time.perf_counter()
                    self._end(reading, self._accept_one(reading, logits[-1]))
            elif reading in self.running:  # (alone, and still no room)
                self._finish(reading, None, error=f"the prompt ({len(reading.ids)} tokens) does not fit in the KV "
                                                  f"cache (--cache_lens {engine.cache.capacity})")
        t0 = time.perf_counter()
        if self._ahead is not None:
            self._continue(reading is None)
        else:
            self._decode()
        self.stats.decode_s += time.perf_counter() - t0

    # -- decode steps -----------------------------------------------------------------------
    def _decode(self) -> None:
        """One decode step of every request ready for one (its next token known on the host)."""
        decoding = [r for r in self.running if r.begin is None and r.next_token is not None]
        for r in list(decoding):
            if r in self.running and not self._room_for(r, 1) and r in self.running:
                self._finish(r, "length")  # (alone, it outgrows the whole cache)
        decoding = [r for r in decoding if r in self.running]  # (less those ended or preempted)
        if not decoding:
            return
        engine = self.engine
        # (the penalty reads the history on the host; a grammar masks each row before its draw)
        if any(r.params.repetition_penalty != 1 or r.grammar is not None for r in decoding):
            engine._set_phase("generate")
            logits = engine.step([r.seq for r in decoding], [[r.next_token] for r in decoding])
            self._count(len(decoding))
            constrained = [i for i, r in enumerate(decoding) if r.grammar is not None]
            if constrained:  # (in place, on the logits' device)
                mask_rows(logits, [decoding[i].grammar for i in constrained], constrained)
            argmax = logits.argmax(dim=-1).tolist()  # every greedy request's choice, in one op
            for r, row, best in zip(decoding, logits, argmax):
                plain = r.params.greedy and r.params.repetition_penalty == 1
                self._end(r, self._accept_one(r, row, best if plain else None, masked=True))
            return
        step = engine.issue([r.seq for r in decoding], [r.next_token for r in decoding], self._samplers(decoding),
                            fed=[r.next_token for r in decoding])
        self._count(len(decoding))
        for r in decoding:
            r.next_token = None  # (on the device, in the step's picks)
        if self._may_run_ahead(decoding):
            self._ahead = (step, decoding)
        else:
            self._take(decoding, engine.finish(step), None)

    def _continue(self, steady: bool) -> None:
        """The step in flight: enqueue the next one on its picks first where the batch stays the
        same (`steady`: no prompt is being read), then read it."""
        step, reqs = self._ahead
        self._ahead = None
        nxt = None
        if steady and self._may_run_ahead(reqs) and all(self._make_room(r.seq, 1) for r in reqs):
            try:
                nxt = self.engine.issue([r.seq for r in reqs], step.out, self._samplers(reqs))
                self._count(len(reqs))
            except Exception:
                self.engine.drop([step], report=False)
                raise
        try:
            tokens = self.engine.finish(step, last=nxt is None)
        except Exception:
            if nxt is not None:
                self.engine.drop([nxt], report=False)
            raise
        self._take(reqs, tokens, nxt)

    def _take(self, reqs: list[Request], tokens: list[int], nxt) -> None:
        """A step's picks to its requests; `nxt`: the step issued on them, in flight. Where one of
        them ends, that step (which holds an entry for it) is read now as well."""
        ends = [self._accept_one(r, None, t) if t >= 0 else (None, NOTHING_TO_DRAW, True)
                for r, t in zip(reqs, tokens)]
        if nxt is not None:
            nxt.fed = tokens
            if not any(ends):
                for r in reqs:
                    r.next_token = None
                self._ahead = (nxt, reqs)
                return
            more = self.engine.finish(nxt)  # (its rows of the requests ending are never read)
            for r, end in zip(reqs, ends):
                self._end(r, end)
            for r, t, end in zip(reqs, more, ends):
                if end is None:
                    self._end(r, self._accept_one(r, None, t) if t >= 0 else (None, NOTHING_TO_DRAW, True))
            return
        for r, end in zip(reqs, ends):
            self._end(r, end)

    def _drain(self) -> None:
        """Read the step in flight, if any, before the batch changes."""
        if self._ahead is not None:
            step, reqs = self._ahead
            self._ahead = None
            self._take(reqs, self.engine.finish(step), None)

    def _may_run_ahead(self, reqs: list[Request]) -> bool:
        """Whether the next step may be enqueued before this one's picks are read: each request
        can take two more tokens (the pick in flight and the next) and none is cancelled."""
        return self.run_ahead and all(not r.cancelled and len(r.tokens) + 2 <= r.max_tokens and r.grammar is None
                                      for r in reqs)

    @staticmethod
    def _samplers(reqs: list[Request]) -> list[Sampler | None]:
        return [None if r.params.greedy else r._sampler for r in reqs]

    def _count(self, rows: int) -> None:
        self.stats.decode_steps += 1
        self.stats.decode_tokens += rows

    def _end(self, r: Request, end: tuple | None) -> None:
        if end is not None:
            self._finish(r, *end)

    def _fits(self, r: Request) -> bool:
        """Whether `r`'s prompt (and its answer so far, when it resumes) and one more token fit in
        the cache pages free now (those the prefix cache holds count: it gives them back)."""
        pages = -(-(len(r.prompt_ids) + len(r.tokens) + 1) // self.engine.cache.page_size)
        return pages <= self.free_pages()

    def _make_room(self, seq: Sequence, n: int) -> bool:
        cache = self.engine.cache
        while not cache.can_grow(seq, n):
            if self.pool is None or not self.pool.evict_one():
                return False
        return True

    def _room_for(self, r: Request, n: int) -> bool:
        """Room for `n` more tokens of `r`: from the prefix cache, else by preempting the running
        requests admitted after it, newest first (their pages saved a tier down; they wait first
        in line and resume where they were). Where that is not enough, `r` is preempted itself
        (False, `r` no longer running), unless it runs alone (False, `r` running: it outgrows the
        whole cache)."""
        while not self._make_room(r.seq, n):
            later = self.running[self.running.index(r) + 1:]
            if later:
                self._preempt(later[-1])
            elif len(self.running) > 1:
                self._preempt(r)
                return False
            else:
                return False
        return True

    def _preempt(self, r: Request) -> None:
        """Give up `r`'s cache pages (its full ones kept in the prefix tiers) and put it first in
        line: it resumes by a prefill of its prompt and answer so far, most of it found again in
        the prefix cache."""
        self.running.remove(r)
        seq, r.seq = r.seq, None
        if self.pool is not None:
            self.pool.store_and_release(seq)
        else:
            self.engine.release(seq)
        r.begin, r.next_token = None, None
        r.preempted += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(r)
        with self._lock:
            self._pending += 1

    def _accept_one(self, r: Request, logits: torch.Tensor | None, token: int | None = None,
                    masked: bool = False) -> tuple | None:
        """_accept, a failure ending only this request."""
        try:
            return self._accept(r, logits, token, masked)
        except Exception as e:
            return None, f"{type(e).__name__}: {e}", True

    def _accept(self, r: Request, logits: torch.Tensor | None, token: int | None = None,
                masked: bool = False) -> tuple | None:
        """Sample r's next token from its logits [V] (or take `token`, already chosen; `masked`:
        the logits went through r's grammar already), stream its text; how r ends now, as
        _finish's (reason, error, flush), or None while it goes on (its next_token then set)."""
        if not hasattr(r, "_sampler"):
            r._sampler = Sampler(r.params)
            r._decoder = StreamDecoder(self.tokenizer, skip_special_tokens=not r.keep_special)
            r._stopper = StopMatcher(r.stop) if r.stop else None
            r._history = list(r.prompt_ids)
            r._channels = r.harmony.stream() if r.harmony is not None else None
        if token is None:  # (drawn on the logits' device, by its generator: the draws Engine.generate makes)
            row = logits.float()
            if r.grammar is not None and not masked:
                row = r.grammar.mask(row.clone())
            token = int(r._sampler(row[None], [r._history])[0])
        if r.grammar is not None and not r.grammar.accept(token):
            return None, f"the grammar refused token {token}", True
        r.tokens.append(token)
        r._history.append(token)
        if (token in self.eos_ids or token in r.stop_ids) and not r.ignore_eos:
            return "stop", None, True
        if r._channels is not None:  # harmony: the final channel is the text, the others reasoning
            _emit_channels(r, r._channels.push(token))
        else:
            text = r._decoder.push(token)
            if r._stopper is not None:
                text, stopped = r._stopper.push(text)
                if text:
                    r.emit("text", text)
                if stopped:
                    r.stop_hit = r._stopper.hit
                    return "stop", None, False
            elif text:
                r.emit("text", text)
        if len(r.tokens) >= r.max_tokens:
            return "length", None, True
        r.next_token = token
        return None

    def _finish(self, r: Request, reason: str | None, error: str | None = None, flush: bool = True) -> None:
        r.finish_reason, r.t_done = reason, time.perf_counter()
        if r in self.running:
            self.running.remove(r)
        if reason in ("stop", "length") and getattr(r, "_channels", None) is not None:
            _emit_channels(r, r._channels.finish())
        elif reason in ("stop", "length") and flush and hasattr(r, "_decoder"):
            tail = r._decoder.flush()
            if r._stopper is not None:
                text, stopped = r._stopper.push(tail)
                tail = text if stopped else text + r._stopper.flush()
                if stopped:
                    r.stop_hit = r._stopper.hit
            if tail:
                r.emit("text", tail)
        if r.seq is not None:
            keep = self.pool is not None and reason in ("stop", "length")
            self.pool.put(r.seq) if keep else self.engine.release(r.seq)
        r.emit("error", error) if error else r.emit("done", reason)
        for hook in self.on_finish:
            try:
                hook(r)
            except Exception:  # (an observer's failure is not the request's)
                traceback.print_exc()
