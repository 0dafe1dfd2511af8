"""The generation engine: chunked prefill and decode over a preallocated paged cache.

One step, top-down (`Engine.step`): the cache reserves room for each sequence's new tokens and
describes the step (`ForwardBatch`); the model's own decoder runs on the packed tokens with
their absolute positions while the attention operators read/write the cache through the model's
run context; the lm_head runs only on each sequence's last token. Prefill feeds a prompt in
chunks of `chunk_size` tokens; decode feeds one token per sequence per step.

`Engine.generate` wraps that in one answer: sampling, stop on EOS ids / stop strings / length,
streamed text that never splits a UTF-8 character, and the timing stats upstream prints.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..cache import CacheFullError, PagedCache, Sequence, make_cache
from ..operators.base import set_phase
from ..operators.context import RunContext
from ..operators.experts import link_expert_deferral, link_layerwise_prefill
from ..operators.layer import KDecoderLayer, link_decoder_layers
from ..operators.rope import rotary_tables
from .sampling import NOTHING_TO_DRAW, Sampler, SamplingParams
from .devices import indexed_device, module_device
from .streaming import StopMatcher, StreamDecoder


# torch's intra-op threads as they were before an engine dropped them to one for CPU decode:
# an engine made after another one's decode must not take that one thread for its prefill
_THREADS_BEFORE_DECODE: int | None = None


def _torch_threads() -> int:
    current = torch.get_num_threads()
    return _THREADS_BEFORE_DECODE if current == 1 and _THREADS_BEFORE_DECODE else current


def _set_torch_threads(n: int) -> None:
    global _THREADS_BEFORE_DECODE
    current = torch.get_num_threads()
    if n == 1 and current != 1:
        _THREADS_BEFORE_DECODE = current
    torch.set_num_threads(n)


@dataclass
class StepTimes:
    """Where a step's wall time goes on the host: `issue_s`, from the step's start until its work
    is enqueued (the cache's bookkeeping, the graph's inputs, the replay or the eager forward's
    launches: Python, during which a GPU done with the step before sits idle until the first
    launch, unless the step was issued ahead while that one ran: Engine.decode_tokens), and
    `wait_s`, from then (from the start of the wait, for a step issued ahead) until the GPU is
    done and its CPU experts' errors are checked (about nothing on a CPU cache, which computes
    while issuing). Sums since `reset()`."""
    steps: int = 0
    issue_s: float = 0.0
    wait_s: float = 0.0

    def add(self, issue_s: float, wait_s: float) -> None:
        self.steps += 1
        self.issue_s += issue_s
        self.wait_s += wait_s

    def reset(self) -> None:
        self.steps, self.issue_s, self.wait_s = 0, 0.0, 0.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    eval_tokens: int = 0
    eval_seconds: float = 0.0

    def lines(self) -> list[str]:
        """Upstream's labels with the values in one column, as it prints them: counts in tokens,
        durations in seconds and rates in tokens/s, both to two decimals."""
        def rate(n, s):
            return n / s if s > 0 else 0.0
        rows = [("prompt eval count", f"{self.prompt_tokens} token(s)"),
                ("prompt eval duration", f"{self.prompt_seconds:.2f}s"),
                ("prompt eval rate", f"{rate(self.prompt_tokens, self.prompt_seconds):.2f} tokens/s"),
                ("eval count", f"{self.eval_tokens} token(s)"),
                ("eval duration", f"{self.eval_seconds:.2f}s"),
                ("eval rate", f"{rate(self.eval_tokens, self.eval_seconds):.2f} tokens/s")]
        return [f"{label + ':':<22}{value}" for label, value in rows]


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the model's generation_config and config, and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@dataclass
class Generation:
    """One answer in progress: iterate it for text pieces; `tokens`, `finish_reason` ("stop",
    "length" or "cache_full") and `stats` are complete once iteration ends."""

    engine: Engine
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop: Seq[str] = ()
    eos_ids: set[int] = field(default_factory=set)
    seq: Sequence | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[str]:
        decoder = StreamDecoder(self.engine.tokenizer) if self.engine.tokenizer is not None else None
        stopper = StopMatcher(self.stop) if self.stop else None
        tokens = self.token_ids()
        try:
            for token in tokens:
                if decoder is None:
                    continue
                text = decoder.push(token)
                if stopper is not None:
                    text, stopped = stopper.push(text)
                    if text:
                        yield text
                    if stopped:
                        self.finish_reason = "stop"
                        return
                elif text:
                    yield text
            if decoder is not None:
                tail = decoder.flush()
                if stopper is not None:
                    text, stopped = stopper.push(tail)
                    tail = text if stopped else text + stopper.flush()
                if tail:
                    yield tail
        finally:
            tokens.close()

    def token_ids(self) -> Iterator[int]:
        """The answer's token ids as they come (stop strings do not apply: text is not decoded;
        what harmony's parser reads)."""
        seq = self.seq or self.engine.cache.new_sequence()
        tokens = self._tokens(seq)
        try:  # (the finally below frees a sequence of our own even when the prefill fails)
            yield from tokens
        finally:
            try:
                tokens.close()  # (a step issued ahead and not wanted: waited for, its entry dropped)
            finally:
                if self.seq is None:
                    self.engine.release(seq)

    def _tokens(self, seq: Sequence) -> Iterator[int]:
        """The answer's tokens, each appended to `tokens` before it is yielded, until EOS, the
        length limit or a full cache (`finish_reason`); the stats are complete once it ends."""
        engine, sampler = self.engine, Sampler(self.params)
        history = list(self.prompt_ids)
        t0 = t_eval = time.perf_counter()
        ahead = None
        try:
            logits = engine.prefill(seq, self.prompt_ids)
            self.stats.prompt_tokens = engine.last_prefill_tokens
            self.stats.prompt_seconds = time.perf_counter() - t0
            t_eval = time.perf_counter()
            token = int(sampler(logits, [history])[0])
            while True:
                self.tokens.append(token)
                history.append(token)
                if token in self.eos_ids:  # (kept in `tokens`, never shown)
                    self.finish_reason = "stop"
                    return
                yield token
                if len(self.tokens) >= self.max_new_tokens:
                    self.finish_reason = "length"
                    return
                if self.params.repetition_penalty == 1:  # (no history needed: one step ahead)
                    if ahead is None:
                        ahead = engine.decode_tokens(seq, token, self.max_new_tokens - len(self.tokens),
                                                     None if self.params.greedy else sampler)
                    token = next(ahead, None)
                elif engine.cache.can_grow(seq, 1):
                    token = int(sampler(engine.decode(seq, token), [history])[0])
                else:
                    token = None
                if token is None:  # (decode_tokens stops early only where the cache cannot grow)
                    self.finish_reason = "cache_full"
                    return
        finally:
            try:
                if ahead is not None:
                    ahead.close()
            finally:
                self.stats.eval_tokens = len(self.tokens)
                self.stats.eval_seconds = time.perf_counter() - t_eval


def _run_layer(layer: torch.nn.Module, hidden: torch.Tensor, normed: torch.Tensor | None, kwargs: dict):
    """(the layer's output, the next layer's input norm of it or None)."""
    if isinstance(layer, KDecoderLayer):
        return layer.step(hidden, normed, **kwargs)
    out = layer(hidden, **kwargs)
    return (out[0] if isinstance(out, tuple) else out), None  # (layers of older releases return tuples)


@dataclass
class _Ahead:
    """A decode step issued (Engine.issue): its sequences and where each one's token went in the
    cache, its picks on the logits' device (the next step's input) and on the host once `event`
    is reached (-1: a row with nothing to draw from), its CPU experts' host calls, its input
    tokens where known on the host, and the host's time issuing it. Without an event the step ran
    when it was issued (no graph replayed ahead: the CPU, several GPUs) and `host` holds the picks."""
    seqs: list[Sequence]
    starts: list[int]
    out: torch.Tensor
    host: torch.Tensor | list[int]
    event: torch.cuda.Event | None
    calls: list  # its CPU experts' (host call, name) pairs
    fed: list[int] | None
    issue_s: float


def _picks(logits: torch.Tensor, samplers: list[Sampler | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, feed) of a step's logits [B, V], on their device, nothing read back: each row's
    argmax (sampler None) or its sampler's draw; `out` flags a row with nothing to draw from as
    -1, `feed` keeps an in-range token there (the next step's embedding reads it)."""
    if all(s is None for s in samplers):
        picked = logits.argmax(dim=-1)
        return picked, picked
    greedy = logits.argmax(dim=-1)
    out, feed = [], []
    for i, sampler in enumerate(samplers):
        if sampler is None:
            out.append(greedy[i:i + 1])
            feed.append(greedy[i:i + 1])
            continue
        picked, valid = sampler.pick(logits[i:i + 1])
        out.append(picked if valid is None else torch.where(valid, picked, -1))
        feed.append(picked)
    return torch.cat(out), torch.cat(feed)


# The prompt lengths a warm-up prefills, so that a user's prompt meets kernels already compiled and
# loaded. Triton specializes an int argument on whether it is 1 or a multiple of 16 (16, 21, and 32
# in the 17-64 row block); past 64 tokens the quantized linears dequantize for a cuBLAS GEMM and the
# q/k norms and RoPE leave the fused launch (100), past 128 the norms are torch's (200).
WARM_UP_PROMPTS = (16, 21, 32, 100, 200)
# (cached tokens, new tokens): prompts that extend a cached prefix (a chat's next turn, the
# server's prefix cache) start their chunk past 0: at 1, and at an odd start, whose slot views
# are not 16-byte aligned
WARM_UP_CONTINUATIONS = ((1, 20), (21, 21))


class Engine:
    """Runs a loaded model (transformers' class with operators injected) over a paged cache.

    `cache_lens` token slots are preallocated (`page_size` per page); `chunk_size` bounds the
    tokens of one prefill forward. The engine owns the cache and hands it to the model's
    RunContext, which the attention operators read."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, cache_lens: int = 4096, page_size: int = 256,
                 chunk_size: int = 512, cache: PagedCache | None = None, use_cuda_graph: bool = False,
                 max_batch: int = 8):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.model, self.tokenizer, self.chunk_size = model, tokenizer, chunk_size
        self.config = model.config
        self.context: RunContext = getattr(model, "kt_context", None) or RunContext()
        model.kt_context = self.context
        attention = self._attention_layers()
        self.embed = model.get_input_embeddings()
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        devices = [indexed_device(a.device) for a in attention]  # every layer's device (its attention's)
        # layers spread over several devices: hidden states (and RoPE tables) move at the boundaries
        self.layer_devices, self.pipelined = devices, len(set(devices)) > 1
        self.cache = cache or make_cache(self.config, cache_lens, page_size, devices[0], dtype,
                                         devices if self.pipelined else None, max_seqs=max_batch)
        self.context.cache = self.cache
        self._tokens: dict[int, list[int]] = {}  # per sequence: the tokens whose entries are cached
        self._phase = None
        # Decode on the CPU: torch's own ops are tiny there, and its OpenMP threads spinning after
        # each op would steal the cores the expert kernels' threads stream weights on.
        self.cpu_decode = self.cache.device.type == "cpu"
        self.torch_threads = _torch_threads()
        self.last_prefill_tokens = 0
        self.on_cuda = self.cache.device.type == "cuda"
        self._done_events: dict[torch.device, torch.cuda.Event] = {}  # see _wait_gpu
        self._ahead_slots: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # see issue()
        self._ahead_next = 0
        self._ahead_active = False  # a decode_tokens iterator has steps in flight
        self.step_times = StepTimes()
        self._cores = len(os.sched_getaffinity(0))
        link_layerwise_prefill(self.model)
        link_expert_deferral(self.model)
        link_decoder_layers(self.model.model.layers)
        # decode steps of up to max_batch sequences replay CUDA graphs (GPU caches only)
        self.graphs = None
        # (graphs replay what capture saw: only attention that reads the step's slot table from
        # static buffers — the Triton path — may be captured)
        if use_cuda_graph and self.on_cuda and all(a.triton for a in attention):
            from .graphs import DecodeGraphs, unsupported
            reason = unsupported(self)
            if reason is None:
                self.graphs = DecodeGraphs(self, max_batch)
            else:
                warnings.warn(f"use_cuda_graph: decoding without CUDA graphs: {reason}", stacklevel=2)

    def _attention_layers(self) -> list:
        """Every layer's token mixer: its cached attention operator, or in a hybrid model's
        linear-attention layers the gated DeltaNet operator; all share the engine's run context."""
        from ..operators.attention import _CachedAttention
        from ..operators.deltanet import KGatedDeltaNet
        layers = [m for m in self.model.modules() if isinstance(m, (_CachedAttention, KGatedDeltaNet))]
        if len(layers) != self.config.num_hidden_layers:
            raise ValueError(f"the engine needs every layer's self_attn replaced by a cached attention operator "
                             f"(KDeepseekV2Attention / KGQAAttention) and every linear_attn by KGatedDeltaNet; "
                             f"found {len(layers)} of {self.config.num_hidden_layers}: add the rules to the rule file")
        for m in layers:
            m.context = self.context
        return layers


    def _set_phase(self, phase: str) -> None:
        if phase != self._phase:
            set_phase(self.model, phase)
            self._phase = phase
            if self.cpu_decode:
                _set_torch_threads(1 if phase == "generate" else self.torch_threads)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> torch.Tensor:
        """Feed `new_tokens[i]` to `seqs[i]` in one forward; logits of each one's last token [n, V]."""
        began = time.perf_counter()
        batch = self.cache.prepare(seqs, [len(t) for t in new_tokens])
        try:
            if self.graphs is not None and len(seqs) <= self.graphs.max_batch and all(len(t) == 1 for t in new_tokens):
                logits = self.graphs.run(batch, [t[0] for t in new_tokens])
            else:
                logits = self._eager_step(batch, new_tokens)
            issued = time.perf_counter()
            if self.on_cuda:  # CPU experts ran from the stream(s): raise what they failed with
                self._wait_gpu()
                self.context.rest_host_calls()
                self.context.check_host_errors()
            self.step_times.add(issued - began, time.perf_counter() - issued)
        except BaseException:
            for s, start in zip(seqs, batch.starts):  # the step did not happen: forget its tokens
                self.cache.truncate(s, start)
            raise
        for s, tokens in zip(seqs, new_tokens):
            self._tokens.setdefault(s.seq_id, []).extend(tokens)
        return logits

    def _wait_gpu(self) -> None:
        """Wait for the step's GPU streams. Where the CPU experts' threads fed from them leave
        fewer than two cores (for this thread and the CUDA driver's), sleep on a blocking event:
        cudaStreamSynchronize spins, and a spinning thread here takes a core from the experts."""
        crowded = self._crowded()
        for device in sorted({d for d in self.layer_devices if d.type == "cuda"}, key=str):
            stream = torch.cuda.current_stream(device)
            if not crowded:
                stream.synchronize()
                continue
            event = self._done_events.get(device)
            if event is None:
                event = self._done_events[device] = torch.cuda.Event(blocking=True)
            event.record(stream)
            event.synchronize()

    def _crowded(self) -> bool:
        """Whether the CPU experts' threads leave fewer than two cores (for this thread and the
        CUDA driver's): waits for the GPU then sleep on blocking events instead of spinning."""
        return self.context.cpu_pool_threads() + 2 > self._cores

    def _eager_step(self, batch, new_tokens: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.long,
                           device=self.embed.weight.device)[None]
        self.context.batch = batch
        try:
            hidden = self._decoder(ids, batch.positions.to(ids.device)[None])
        finally:
            self.context.batch = None
        if batch.num_tokens == len(batch.q_lens):  # a token each (decode): every row is a last one
            return self.model.lm_head(hidden[0]).float()
        last = torch.tensor(batch.q_lens).cumsum(0) - 1
        return self.model.lm_head(hidden[0, last.to(hidden.device)]).float()

    def _decoder(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """transformers' decoder layers run in order, as its model forward runs them, minus the
        causal-mask building (the attention operators mask by the batch's positions)."""
        base = self.model.model
        hidden = base.embed_tokens(ids)
        position_embeddings = rotary_tables(base.rotary_emb, hidden, positions)
        hidden = self.run_layers(hidden, positions, position_embeddings, range(self.config.num_hidden_layers))
        return base.norm(hidden.to(module_device(base.norm, hidden.device)))

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, position_embeddings: tuple,
                   layers: range) -> torch.Tensor:
        """Decoder layers `layers` on `hidden`; with layers on several GPUs the hidden states (and
        positions, RoPE tables) move to the next GPU at a boundary, each layer running with its
        GPU current (its kernels and host functions on that GPU's stream). A KDecoderLayer may
        hand the next layer its input norm, computed with its own last add (LayerPlan)."""
        tables = {hidden.device: position_embeddings}
        normed = None
        for i in layers:
            layer = self.model.model.layers[i]
            if self.pipelined and hidden.device != self.layer_devices[i]:
                device = self.layer_devices[i]  # a pipeline boundary: the next GPU takes over
                hidden, normed = hidden.to(device), None
                if device not in tables:
                    tables[device] = tuple(t.to(device) for t in position_embeddings)
                positions = positions.to(device)
            kwargs = dict(attention_mask=None, position_ids=positions, position_embeddings=tables[hidden.device])
            if self.pipelined and hidden.device.type == "cuda":
                with torch.cuda.device(hidden.device):
                    hidden, normed = _run_layer(layer, hidden, normed, kwargs)
            else:
                hidden, normed = _run_layer(layer, hidden, normed, kwargs)
        return hidden

    def prefill(self, seq: Sequence, prompt_ids: list[int]) -> torch.Tensor:
        """Bring `seq` to hold `prompt_ids` (reusing the longest cached common prefix, always
        recomputing at least the last token) in chunks; logits after the last token [1, V]."""
        begin = self.prefill_start(seq, prompt_ids)
        logits = None
        while begin < len(prompt_ids):
            logits, begin = self.prefill_chunk(seq, prompt_ids, begin)
        return logits

    def prefill_start(self, seq: Sequence, prompt_ids: list[int]) -> int:
        """Keep the longest prefix of `prompt_ids` that `seq` already holds (never the whole prompt:
        the last token is recomputed for its logits) and forget the rest; the position from which
        the prompt must be computed (`last_prefill_tokens` says how many tokens that leaves)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.cache.capacity:
            raise CacheFullError(f"the prompt has {len(prompt_ids)} tokens but the cache holds {self.cache.capacity} "
                                 f"(--cache_lens); raise --cache_lens or shorten the prompt")
        cached = self._tokens.get(seq.seq_id, [])
        keep = self.cache.restorable(seq, min(common_prefix(cached, prompt_ids), len(prompt_ids) - 1))
        if keep < seq.length:
            self.cache.truncate(seq, keep)
            self._tokens[seq.seq_id] = cached[:keep]
        self.last_prefill_tokens = len(prompt_ids) - keep
        return keep

    def prefill_chunk(self, seq: Sequence, prompt_ids: list[int], begin: int) -> tuple[torch.Tensor, int]:
        """Compute one chunk (`chunk_size` tokens) of the prompt from `begin`: (logits after it [1, V],
        the next begin)."""
        self._set_phase("prefill")
        end = min(len(prompt_ids), begin + self.chunk_size)
        return self.step([seq], [prompt_ids[begin:end]]), end

    def cached_tokens(self, seq: Sequence) -> list[int]:
        """The tokens whose entries `seq` holds in the cache."""
        return self._tokens.get(seq.seq_id, [])

    def adopt(self, seq: Sequence, tokens: list[int]) -> None:
        """Record that `seq` holds the entries of `tokens` (filled from elsewhere, e.g. a prefix store)."""
        if len(tokens) != seq.length:
            raise ValueError(f"{len(tokens)} tokens for a sequence holding {seq.length}")
        self._tokens[seq.seq_id] = list(tokens)

    def decode(self, seq: Sequence, token: int) -> torch.Tensor:
        self._set_phase("generate")
        return self.step([seq], [[token]])

    # -- decode, one step ahead ---------------------------------------------------------------
    def greedy_tokens(self, seq: Sequence, token: int, limit: int) -> Iterator[int]:
        """The greedy continuation of `seq` after `token`: decode_tokens with argmax picks."""
        return self.decode_tokens(seq, token, limit)

    def decode_tokens(self, seq: Sequence, token: int, limit: int, sampler: Sampler | None = None) -> Iterator[int]:
        """The continuation of `seq` after `token` (not yet fed), at most `limit` tokens, one an
        iteration, each the logits' argmax or, with `sampler` (no repetition penalty: it needs
        the history on the host), its draw; it ends early when the cache cannot grow. With CUDA
        graphs (one GPU) each step is issued before the previous one's token is read back: its
        input is the token the GPU picked, so neither the GPU nor the CPU experts wait for Python
        between steps. Closing the iterator early waits for the step
        issued ahead and drops its cache entry (its draw was made: a sampler used again after an
        early close is a draw further on than step by step). Otherwise each step is decode() and
        the pick (the same tokens: the sampler draws on the logits' device either way). Logits
        with nothing to draw from raise ValueError, the step that gave them dropped."""
        if sampler is not None and sampler.params.repetition_penalty != 1:
            raise ValueError("decode_tokens: a repetition penalty needs each step's history (use decode())")
        self._set_phase("generate")
        if not self.decodes_ahead() or self._ahead_active:  # (one iterator ahead at a time on an engine)
            for _ in range(limit):
                if not self.cache.can_grow(seq, 1):
                    return
                logits = self.decode(seq, token)
                try:
                    token = int(logits[0].argmax() if sampler is None else sampler(logits)[0])
                except ValueError:  # nothing to draw from: the step is dropped, as ahead
                    self.cache.truncate(seq, seq.length - 1)
                    self._tokens[seq.seq_id].pop()
                    raise
                yield token
            return
        self._ahead_active = True
        pending: list[_Ahead] = []  # steps issued, oldest first: each one's input is the one before's pick
        issued = 0
        failing = None  # the exception leaving the loop, if any (a close() is a GeneratorExit)
        try:
            while True:
                while issued < limit and len(pending) < 2 and self.cache.can_grow(seq, 1):
                    pending.append(self.issue([seq], pending[-1].out if pending else [token], [sampler],
                                              fed=None if pending else [token]))
                    issued += 1
                if not pending:
                    return
                token = self.finish(pending[0], last=len(pending) == 1)[0]  # (an error: the finally drops it too)
                if token < 0:  # the sampler's flag (this step and the next are dropped by the finally)
                    raise ValueError(NOTHING_TO_DRAW)
                pending.pop(0)
                if pending:
                    pending[0].fed = [token]  # the next step's input, now known on the host
                yield token
        except BaseException as e:
            failing = e
            raise
        finally:
            self._ahead_active = False
            if pending:  # issued ahead and not wanted (or failed): wait for them, drop their entries
                self.drop(pending, report=failing is None or isinstance(failing, GeneratorExit))

    def decodes_ahead(self) -> bool:
        """Whether issue() enqueues a step without waiting for it (CUDA graphs on one GPU)."""
        return self.graphs is not None and len(self.graphs.segments) == 1

    @torch.inference_mode()
    def issue(self, seqs: list[Sequence], tokens, samplers: list[Sampler | None],
              fed: list[int] | None = None) -> _Ahead:
        """One decode step of `seqs` on `tokens` (host ints, or the `out` of the step issued before
        with the same sequences: its picks, not yet read back), each row's pick (the argmax where
        its sampler is None, else its draw; no repetition penalty: that needs the history on the
        host) and the picks' copy to the host; `fed`: the inputs where known on the host. With
        decodes_ahead() the step is only enqueued (a graph replay): finish() waits for it. Otherwise
        it runs now. The cache room is taken here; a failure gives it back."""
        self._set_phase("generate")
        began = time.perf_counter()
        if not self.decodes_ahead():
            ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
            starts = [s.length for s in seqs]
            logits = self.step(seqs, [[t] for t in ids])
            out, feed = _picks(logits, samplers)
            return _Ahead(seqs, starts, feed, out.tolist(), None, [], ids, time.perf_counter() - began)
        B = len(seqs)
        if len(self._ahead_slots) == 0 or self._ahead_slots[0][0].numel() < B:
            # pinned words and events for the picks of steps in flight (at most 2, 4 kept)
            self._ahead_slots = [(torch.zeros(max(B, self.graphs.max_batch), dtype=torch.long, pin_memory=True),
                                  torch.cuda.Event(blocking=self._crowded())) for _ in range(4)]
        host, event = self._ahead_slots[self._ahead_next % len(self._ahead_slots)]
        event.synchronize()  # (the slot's last step was read back already; at once for a fresh event)
        batch = self.cache.prepare(seqs, [1] * B)
        try:
            logits, calls = self.graphs.run_ahead(batch, tokens)
            self._ahead_next += 1
            with torch.cuda.device(logits.device):  # (the model's GPU, which need not be the current one)
                out, feed = _picks(logits, samplers)  # (read before the next replay rewrites the graph's logits)
                host[:B].copy_(out, non_blocking=True)
                event.record()
        except BaseException:
            for s, start in zip(seqs, batch.starts):
                self.cache.truncate(s, start)
            raise
        return _Ahead(seqs, list(batch.starts), feed, host, event, calls, fed, time.perf_counter() - began)

    @torch.inference_mode()
    def finish(self, step: _Ahead, last: bool = True) -> list[int]:
        """Wait for an issued step: each row's pick (-1: its logits held nothing to draw from).
        `last`: no other step is in flight. A CPU-experts error seen now fails the step (the
        one in flight too runs the same calls). Set `step.fed` first where it was not known."""
        if step.event is None:  # (it ran when issued)
            return list(step.host)
        t0 = time.perf_counter()
        step.event.synchronize()
        if last:
            self.context.rest_host_calls()
        staging = self.context.staging
        if staging is not None:
            staging.check_calls(step.calls)
        if step.fed is None or len(step.fed) != len(step.seqs):
            raise ValueError("finish: the step's inputs (fed) are not known on the host")
        picks = step.host[:len(step.seqs)].tolist()
        self.step_times.add(step.issue_s, time.perf_counter() - t0)
        for s, token in zip(step.seqs, step.fed):
            self._tokens.setdefault(s.seq_id, []).append(token)
        return picks

    def drop(self, steps: list[_Ahead], report: bool = True) -> None:
        """Issued steps that will not be read (or were read and are given up): wait for them and
        forget their cache entries. Their CPU experts' errors are taken (never left for a later
        step to report) and, with `report` (no other error on its way out), raised."""
        earliest: dict[int, tuple[Sequence, int]] = {}
        for step in steps:
            if step.event is not None:
                step.event.synchronize()
            for s, start in zip(step.seqs, step.starts):
                if s.seq_id not in earliest or start < earliest[s.seq_id][1]:
                    earliest[s.seq_id] = (s, start)
        for s, start in earliest.values():
            self.cache.truncate(s, start)
            del self._tokens.setdefault(s.seq_id, [])[start:]
        if not any(step.event is not None for step in steps):
            return
        self.context.rest_host_calls()
        staging = self.context.staging
        if staging is None:
            return
        try:
            staging.check_calls([c for step in steps for c in step.calls])
        except (ValueError, RuntimeError):
            if report:
                raise

    # -- before the first request ------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, batch_sizes: Seq[int] = (1,), prompt_tokens: Seq[int] = WARM_UP_PROMPTS,
                progress: bool = True) -> float:
        """On a GPU: compile the kernels and capture the decode graphs now, not in front of the
        first user: a prefill of each of `prompt_tokens` lengths, prompts that extend a cached
        prefix (WARM_UP_CONTINUATIONS), then one decode step of each of `batch_sizes` sequences
        at once (each graph is captured at its batch size). Triton keeps what it compiles in its
        on-disk cache, so a later process only loads it. The warm-up's cache entries are freed. Seconds taken (0 on the CPU: nothing there compiles)."""
        if not self.on_cuda:
            return 0.0
        began = time.perf_counter()
        sizes = sorted({b for b in batch_sizes if 0 < b <= max(1, self.cache.num_pages)})
        longest = self.cache.capacity - 1
        prompts = [([], n) for n in prompt_tokens] + [([0] * cached, n) for cached, n in WARM_UP_CONTINUATIONS]
        steps = len(prompts) + len(sizes)
        with tqdm(total=steps, desc="compiling GPU kernels", unit="step", disable=not progress) as bar:
            for cached, n in prompts:
                base, ids = cached[:max(longest - 1, 0)], (cached + [0] * n)[:max(longest, 0)]
                seq = self.new_sequence()
                try:
                    if base:
                        self.prefill(seq, base)
                    if ids:
                        self.prefill(seq, ids)
                finally:
                    self.release(seq)
                bar.update()
            for B in sizes:
                seqs = [self.new_sequence() for _ in range(B)]
                try:
                    for seq in seqs:  # one token of context each: a page a sequence
                        self.prefill(seq, [0])
                    self._set_phase("generate")
                    self.step(seqs, [[0]] * B)
                finally:
                    for seq in seqs:
                        self.release(seq)
                bar.set_postfix(batch=B)
                bar.update()
        return time.perf_counter() - began

    def new_sequence(self) -> Sequence:
        return self.cache.new_sequence()

    def release(self, seq: Sequence) -> None:
        self.cache.free(seq)
        self._tokens.pop(seq.seq_id, None)

    # -- one answer -------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, max_new_tokens: int = 256,
                 stop: Seq[str] = (), seq: Sequence | None = None, stop_ids: Seq[int] = ()) -> Generation:
        """An answer to `prompt_ids`; iterate the result for text (or its token_ids()). Pass `seq`
        (from new_sequence) to keep its cache across calls (a chat: the next prompt's common prefix
        is not recomputed); without it the cache is freed when the answer ends. `stop_ids`: tokens
        that end the answer besides the model's EOS (harmony's <|return|>, <|call|>)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        return Generation(self, list(prompt_ids), params or SamplingParams(do_sample=False), max_new_tokens,
                          tuple(stop), eos_token_ids(self.model, self.tokenizer) | set(stop_ids), seq)
