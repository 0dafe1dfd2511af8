"""Grammar-constrained sampling (structured output, forced tool calls) through llguidance: a
JSON schema (or plain JSON) becomes a matcher per request for the model's tokenizer, which masks
its row of logits before each draw (tokens the grammar cannot take next go to -inf) and then
takes the chosen token. The mask is applied where the logits are (a GPU's included), after the
decode step that made them: CUDA-graph decode is unchanged; a constrained request only waits for
its step's logits before its next step is issued.

Shapes: a row of logits [V] (the model's vocabulary, which may be longer than the tokenizer's:
the extra ids are never allowed; or shorter, where a tokenizer counts ids past the embedding,
which no step can draw)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np
import torch


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the server answers 400)."""


def available() -> str | None:
    """None where llguidance imports, else why not."""
    try:
        import llguidance.hf  # noqa: F401
        import llguidance.torch  # noqa: F401
    except ImportError as e:
        return f"structured output needs the llguidance package (pip install llguidance): {e}"
    return None


class Grammars:
    """Grammars over one tokenizer and vocabulary size. Each schema is compiled once (its grammar
    checked and a matcher built: about half a millisecond); a request's matcher is a copy of that
    one's fresh state (about a microsecond), so requests sharing a schema (an agent's tools, a
    response format) start without the compile."""

    TEMPLATES = 64  # compiled schemas kept, the least recently used dropped first

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self._templates: OrderedDict[tuple[str, bool], object] = OrderedDict()
        self._lock = threading.Lock()
        import llguidance.hf
        # (llguidance needs every id the tokenizer has; the masks are cut to the logits' width)
        self.vocab_size = vocab_size = max(vocab_size, len(tokenizer))
        stops = sorted(int(t) for t in stop_ids)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
        except TypeError:  # (llguidance before 1.9 takes one stop token: the answer ends on it)
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                           eos_token=stops[0] if stops else None)

    def json_schema(self, schema: dict | bool, strict: bool = True) -> "Constraint":
        """Output that is one JSON value valid against `schema` (`strict` False: keywords the
        grammar cannot enforce are ignored rather than refused)."""
        from llguidance import LLMatcher
        try:
            key = (json.dumps(schema, sort_keys=True), bool(strict))
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return Constraint(template.deep_copy(), self.vocab_size)
        # (compact JSON: a weak model given free whitespace may never stop writing it)
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False,
                                                                           "lenient": not strict})
        except Exception as e:  # (llguidance raises ValueError/RuntimeError with its parser's message)
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
        template = self._matcher(grammar)
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > self.TEMPLATES:
                self._templates.popitem(last=False)
        return Constraint(template.deep_copy(), self.vocab_size)

    def json_object(self) -> "Constraint":
        """Output that is one JSON object."""
        return self.json_schema({"type": "object"}, strict=False)

    def _matcher(self, grammar: str):
        """A fresh matcher of `grammar`, or GrammarError."""
        from llguidance import LLMatcher
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"the JSON schema cannot be compiled: {error}")
        matcher = LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return matcher


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed int32 bitmask [B, ceil(V / 32)]
        (contiguous, on the host)."""
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2
                or not bitmask.is_contiguous() or not 0 <= row < bitmask.shape[0]):
            raise ValueError(f"a bitmask must be a contiguous int32 host tensor [B, W] and the row in [0, B), got "
                             f"{bitmask.dtype} {list(bitmask.shape)} on {bitmask.device}, row {row}")
        self._write(bitmask.data_ptr() + row * bitmask.shape[1] * 4, bitmask.shape[1] * 4)

    def _write(self, address: int, nbytes: int) -> None:
        """The tokens allowed next as bits into `nbytes` bytes at `address` (a bitmask row)."""
        self._matcher.unsafe_compute_mask_ptr(address, nbytes)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar forbids next set to -inf (in place)."""
        mask_rows(logits.view(1, -1), [self], [0])
        return logits

    def accept(self, token: int) -> bool:
        """Advance by the chosen token; False where the grammar does not allow it."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete: only a stop token may follow."""
        return bool(self._matcher.is_accepting())


def fill(constraints: list[Constraint], vocab: int) -> torch.Tensor:
    """The constraints' next-token bitmasks [n, ceil(V / 32)] int32 on the host (bit i % 32 of word
    i // 32: token i allowed), V the widest of `vocab` and theirs (which a model's logits never
    pass: Grammars' vocabulary is the wider of the model's and the tokenizer's)."""
    width = -(-max([vocab, *(c.vocab_size for c in constraints)]) // 32)
    bitmask = torch.zeros(len(constraints), width, dtype=torch.int32)  # (a word llguidance leaves: nothing allowed)
    row = bitmask.shape[1] * 4
    base = bitmask.data_ptr()
    for j, c in enumerate(constraints):  # (Constraint.fill without its checks: this buffer is made to fit)
        c._write(base + j * row, row)
    return bitmask


def mask_rows(logits: torch.Tensor, constraints: list[Constraint], rows: list[int]) -> None:
    """Mask rows `rows` of a step's logits [B, V] (in place, on their device) by the matching
    constraints: their bitmasks are made on the host (fill), then applied where the logits are, in
    one go (on a GPU a few kilobytes cross the bus, not the logits). (llguidance's own helper goes
    through torch.compile: a compile on a server's first constrained request.)"""
    bitmask = fill(constraints, logits.shape[-1])
    with torch.inference_mode():  # (a step's logits are inference tensors: updated in place only in this mode)
        _mask_rows(logits, bitmask, rows)


@lru_cache(maxsize=1)
def _extension():
    from ..kernels.cpu import load_extension
    return load_extension()


def _mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    V = logits.shape[-1]
    if logits.device.type == "cpu":
        if logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1 and bitmask.is_contiguous():
            index = torch.tensor(rows, dtype=torch.int64)  # (one pass in C++: torch's and numpy's ops take longer to start)
            _extension().mask_logits(logits.data_ptr(), logits.dtype == torch.bfloat16, logits.shape[0],
                                     logits.stride(0), V, index.data_ptr(), len(rows), bitmask.data_ptr(),
                                     bitmask.shape[1])
            return
        allowed = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
                                   .view(bool))
        for j, i in enumerate(rows):
            logits[i].masked_fill_(~allowed[j], float("-inf"))
        return
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :V].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def tool_call_schema(tools: list[dict], named: str | None, parallel: bool) -> dict:
    """The JSON the model must write for a forced tool call: a named function's arguments alone
    (`named`), else an array of one or more {"name", "arguments"} objects of the given tools
    (at most one where `parallel` is False)."""
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if named is not None:
        return by_name[named]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in by_name.items()]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@lru_cache(maxsize=4)
def _grammars(tokenizer, vocab_size: int, stop_ids: frozenset) -> Grammars:
    return Grammars(tokenizer, vocab_size, stop_ids)  # (reading the vocabulary takes a moment: once)


def grammars_for(tokenizer, vocab_size: int, stop_ids) -> Grammars:
    """The (cached) Grammars of a served model."""
    return _grammars(tokenizer, vocab_size, frozenset(int(t) for t in stop_ids))
