"""Next-token choice from logits: repetition penalty, then greedy argmax or temperature / top-k /
top-p sampling from the sampler's own seeded generator (reproducible, never the global RNG).

Shapes: B rows (sequences), V vocabulary. logits [B, V] any float dtype -> tokens [B] int64.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


# The error of a draw whose row of logits was flagged (`Sampler.pick`'s valid False)
NOTHING_TO_DRAW = "logits: a row is all -inf or holds NaN or +inf; nothing to sample from"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. top_k=0 and top_p=1 switch those filters off; temperature 0 or
    do_sample=False mean greedy. seed=None draws a fresh random seed per Sampler."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """True when the choice is a plain argmax."""
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_generation_config(cls, gen_config: Any | None, **overrides: Any) -> SamplingParams:
        """Params from a transformers GenerationConfig (the model's defaults), then `overrides` whose
        value is not None, so CLI flags left unset keep the model's choice. Fields the config leaves
        unset (None, as transformers 5 does) keep our defaults rather than transformers' generate-time
        ones (e.g. its top_k=50)."""
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"overrides: unknown sampling parameter(s) {sorted(unknown)}; valid: {sorted(names)}")
        params = cls()
        if gen_config is not None:
            keys = ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample")
            params = replace(params, **{k: v for k in keys if (v := getattr(gen_config, k, None)) is not None})
        return replace(params, **{k: v for k, v in overrides.items() if v is not None})


def apply_repetition_penalty(logits: torch.Tensor, prev_tokens: list[list[int]], penalty: float) -> torch.Tensor:
    """HF semantics, in place on fp32 logits [B, V]: each token already in row b's history has its
    logit multiplied by `penalty` when negative, divided when not — both make it less likely."""
    for row, prev in zip(logits, prev_tokens):
        if prev:
            idx = torch.tensor(sorted(set(prev)), dtype=torch.long, device=logits.device)
            seen = row[idx]
            row[idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, V] with all but each row's k largest set to -inf (ties at the k-th value kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: per row keep the smallest set of most likely tokens whose probability sums to >= p
    (always at least the top one); the rest -> -inf."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]; 0 for the top token, so it always stays
    drop = (mass_before >= p).scatter(-1, order, mass_before >= p)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Picks next tokens for a batch under fixed SamplingParams, with private torch.Generators so
    a fixed seed reproduces the same tokens and other code's RNG use cannot disturb it. The draw
    is made where the logits are (a GPU's logits by a generator on that GPU, seeded alike), with
    no wait for the device: `pick` returns the tokens as a tensor on it, which a decode step
    issued ahead can take as its input (Engine.decode_tokens)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self._generators = {self.generator.device: self.generator}

    def __call__(self, logits: torch.Tensor, prev_tokens: list[list[int]] | None = None) -> torch.Tensor:
        """Next token per row: logits [B, V], prev_tokens[b] = row b's tokens so far (prompt and
        generated, for the repetition penalty) -> [B] int64 on the logits' device. The caller's
        logits are not modified."""
        tokens, valid = self.pick(logits, prev_tokens)
        if valid is not None and not bool(valid.all()):
            raise ValueError(NOTHING_TO_DRAW)
        return tokens

    def pick(self, logits: torch.Tensor, prev_tokens: list[list[int]] | None = None):
        """(tokens [B] int64, valid [B] bool or None for greedy) on the logits' device, computed
        there without reading anything back: the caller checks `valid` when it reads the tokens
        (False: the row was all -inf or held NaN or +inf, its token meaningless; the error is
        NOTHING_TO_DRAW). A draw is torch.multinomial's own for one sample, without its host-side
        check: argmax(p / q) with q ~ Exp(1) from the generator on the logits' device (the same
        tokens as torch.multinomial(p, 1) given that generator)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        p = self.params
        if p.repetition_penalty != 1 and prev_tokens is not None:
            logits = logits.to(torch.float32, copy=True)  # (penalized in place)
            if len(prev_tokens) != logits.shape[0]:
                raise ValueError(f"prev_tokens has {len(prev_tokens)} rows, logits has {logits.shape[0]}")
            apply_repetition_penalty(logits, prev_tokens, p.repetition_penalty)
        if p.greedy:
            return logits.argmax(dim=-1), None
        gen = self._generator(logits.device)
        graph = _draw_graph(logits, p)
        if graph is not None:
            return graph(logits, gen)
        q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(1, generator=gen)
        return _draw(logits, q, p)

    def _generator(self, device: torch.device) -> torch.Generator:
        """The generator drawing on `device`: the first one's seed, made on first use."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.generator.initial_seed())
        return gen


def _draw(logits: torch.Tensor, q: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid) of logits [B, V] (any float dtype) sampled under `p` with the exponential
    noise q [B, V] float32: argmax(probs / q) over the filtered, tempered softmax."""
    logits = logits.to(torch.float32)
    row_max = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    valid = torch.isfinite(row_max).squeeze(-1)  # (all -inf, a NaN or a +inf: nothing to draw from)
    # Shift by the max first so a tiny temperature cannot overflow to inf (an invalid row: 0s).
    shifted = torch.where(valid[:, None], logits - row_max, 0.0)
    probs = filter_top_p(filter_top_k(shifted / p.temperature, p.top_k), p.top_p).softmax(dim=-1)
    return (probs / q).argmax(dim=-1), valid


class _DrawGraph:
    """_draw of one logits shape, dtype and set of params on one GPU, captured as a CUDA graph:
    a draw is then three launches (the logits into the graph's input, the noise from the caller's
    generator, the replay) instead of a score of eager launches (the top-p sort among them), each
    of which costs the host dearly while the CPU experts keep its cores busy. The same kernels run, so the tokens are
    the eager ones."""

    def __init__(self, like: torch.Tensor, p: SamplingParams) -> None:
        device = like.device
        # (normal tensors even when made under inference mode: later draws outside it update them)
        with torch.inference_mode(False), torch.cuda.device(device):
            self.logits = torch.zeros(like.shape, dtype=like.dtype, device=device)
            self.q = torch.ones(like.shape, dtype=torch.float32, device=device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # (a warm-up before capture: kernels loaded, sort's scratch sized)
                _draw(self.logits, self.q, p)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # captured on a stream of the logits' GPU (torch's default capture stream is the GPU
            # current when it was first made: a capture there would record nothing of this one)
            with torch.cuda.graph(self.graph, stream=side):
                self.tokens, self.valid = _draw(self.logits, self.q, p)

    def __call__(self, logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.cuda.device(self.logits.device):  # (replay() launches on the current GPU's stream)
            self.logits.copy_(logits)
            self.q.exponential_(1, generator=gen)
            self.graph.replay()
            return self.tokens.clone(), self.valid.clone()  # (the graph's outputs are rewritten by its next replay)


_DRAW_GRAPHS: dict = {}  # (device, shape, dtype, temperature, top_k, top_p) -> _DrawGraph, or None: capture failed
_DRAW_GRAPHS_KEPT = 16  # captures a process makes; other keys draw eagerly
# (the graphs' static buffers are shared by every Sampler of the process: draws on one device are
# made from one thread, in stream order, as the engine and the server make them)


def _draw_graph(logits: torch.Tensor, p: SamplingParams) -> _DrawGraph | None:
    """The captured draw for these logits and params on a CUDA device, made on first use (None on
    the CPU, inside another capture, where capture failed or past the first _DRAW_GRAPHS_KEPT
    keys: eager)."""
    if logits.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (logits.device, tuple(logits.shape), logits.dtype, p.temperature, p.top_k, p.top_p)
    if key not in _DRAW_GRAPHS:
        if len(_DRAW_GRAPHS) >= _DRAW_GRAPHS_KEPT:  # (each capture syncs and collects: a bounded number a
            return None  # process, never one a call where params keep changing)
        try:
            _DRAW_GRAPHS[key] = _DrawGraph(logits, p)
        except RuntimeError as e:  # (a torch without capturable sort/topk: eager draws, said once)
            warnings.warn(f"sampling: the draw could not be captured as a CUDA graph ({e}); drawing eagerly")
            _DRAW_GRAPHS[key] = None
    return _DRAW_GRAPHS[key]
