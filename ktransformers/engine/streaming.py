"""Streaming text out of a token stream: StreamDecoder turns token ids into printable text without
ever emitting half of a multi-byte character, decoding only a short window per token; StopMatcher
cuts the text at the first stop string without ever emitting part of one."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def held_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: the part of
    streamed text held back because it may still become a marker (a stop string, a tag)."""
    firsts = {m[0] for m in markers if m}
    for n in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        tail = text[-n:]
        if tail[0] in firsts and any(m.startswith(tail) for m in markers):
            return n
    return 0


class StreamDecoder:
    """Incremental detokenizer. Byte-level BPE tokens can end mid-character, and some tokenizers
    render a token differently depending on its left neighbour, so each push decodes the window
    tokens[prefix_offset:] (the last emitted chunk's tokens plus the pending ones) and emits what it
    adds over tokens[prefix_offset:read_offset]; text ending in U+FFFD is held back until the
    character completes. The stream equals tokenizer.decode(ids, clean_up_tokenization_spaces=False)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are emitted
        self._pieces: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _advance(self, final: bool) -> str:
        """Emit the window's new text (unless it ends mid-character and `final` is False)."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._pieces.append(new)
        return new

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self.tokens.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (U+FFFD if it ended mid-character)."""
        return self._advance(final=True) if self.read_offset < len(self.tokens) else ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)


class StopMatcher:
    """Cuts streamed text at the first occurrence of any stop string. A tail that could still grow
    into a stop string is held back, so no part of a stop string is ever emitted."""

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.hit: str | None = None  # the stop string that stopped the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, stopped). On a stop, the text before the earliest
        stop string is returned with True and everything after is dropped, including later pushes."""
        if self.stopped:
            return "", True
        buf = self._held + text
        hits = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda h: h[0])
            self.stopped, self._held = True, ""
            return buf[:at], True
        n = held_prefix(buf, self.stop)
        self._held = buf[len(buf) - n:]
        return buf[:len(buf) - n], False

    def flush(self) -> str:
        """At the end of generation: the held-back tail, which never became a stop string."""
        held, self._held = self._held, ""
        return held
