"""Reasoning split for thinking models whose chat template wraps the reasoning in <think> ...
</think> (Qwen3, DeepSeek-R1, GLM-4.5, Kimi-K2-Thinking): the streamed answer text is cut into
("reasoning", str) and ("text", str) pieces. Where the rendered prompt already opened the
reasoning (it ends with <think>, as DeepSeek-R1's template does), the answer starts inside it.
(gpt-oss's reasoning is harmony's analysis channel: engine/harmony.py.)"""
from __future__ import annotations

from ..engine.streaming import held_prefix

OPEN, CLOSE = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a chat template is a thinking model's (it writes <think> blocks)."""
    return bool(chat_template) and OPEN in chat_template and CLOSE in chat_template


def opened_in_prompt(prompt_text: str) -> bool:
    """Whether the prompt's tail leaves the answer inside a reasoning block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN) or tail.rfind(OPEN) > tail.rfind(CLOSE)


class ThinkSplitter:
    """Streamed answer text in, ("reasoning" | "text", piece) out. Outside a block, text is text
    until a <think> opens one (only at the start of the answer, give or take whitespace: a
    <think> later in an answer is the model talking about the tag); inside, reasoning until
    </think>. The whitespace right after either tag is dropped (templates put a newline there)."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.may_open = not inside  # a block may still open (nothing but whitespace seen yet)
        self.pending = ""
        self.strip_next = inside  # drop the whitespace that follows a tag

    def push(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.strip_next:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.strip_next = False
            if self.inside:
                at = self.pending.find(CLOSE)
                if at < 0:
                    keep = held_prefix(self.pending, (CLOSE,))
                    self._add(out, "reasoning", self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                self._add(out, "reasoning", self.pending[:at])
                self.pending, self.inside, self.strip_next = self.pending[at + len(CLOSE):], False, True
                continue
            if self.may_open:
                stripped = self.pending.lstrip()
                if stripped.startswith(OPEN):
                    self.pending, self.inside, self.may_open, self.strip_next = stripped[len(OPEN):], True, False, True
                    continue
                if OPEN.startswith(stripped):  # (whitespace, or the start of the tag so far)
                    break
                self.may_open = False
            self._add(out, "text", self.pending)
            self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The rest: an unclosed block's tail is reasoning, anything else text."""
        out: list[tuple[str, str]] = []
        self._add(out, "reasoning" if self.inside else "text", self.pending)
        self.pending = ""
        return out

    @staticmethod
    def _add(out: list, kind: str, piece: str) -> None:
        if piece:
            out.append((kind, piece))


def split_reasoning(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, text) of a whole answer."""
    s = ThinkSplitter(inside)
    parts = {"reasoning": [], "text": []}
    for kind, piece in s.push(text) + s.finish():
        parts[kind].append(piece)
    return "".join(parts["reasoning"]), "".join(parts["text"])
