"""Tool calls in a chat model's generated text: one streaming parser per model format (hermes,
deepseek_v3, kimi_k2, glm45, minimax_m2) splits detokenized text (special tokens kept) into plain
text and ToolCall objects, and parser_for picks the format from a chat template or model type.

A stream emits text as soon as it cannot be the start of a tool-call section, buffers a section up to
its end marker, then emits its calls; a section that does not parse comes back as text, so no text is
ever lost and no malformed output raises."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.streaming import held_prefix

Event = tuple[str, object]  # ("text", str) or ("tool_call", ToolCall)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text
    id: str  # "call_" + 24 hex chars


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


def _loads(text: str) -> Any:
    """json.loads, refusing NaN/Infinity (json.dumps would write them back, and that is not JSON) and raising
    only ValueError, so that no model output can make a parser raise."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # absurdly deep nesting
        raise ValueError("JSON nested too deeply") from None


# No spaces, tags, quotes or JSON brackets: a name spanning a malformed call's markers, or a JSON body
# taken for a glm45 name, is refused rather than becoming a bogus call.
_NAME = re.compile(r"[^\s<>{}\[\]\"']+")


def _call(name: Any, arguments: Any) -> ToolCall | None:
    """A ToolCall from a name and arguments (a dict, or JSON text of an object); None where either is unusable."""
    if not isinstance(name, str) or not _NAME.fullmatch(name.strip()):
        return None
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False), new_call_id())


def _every_call(matches, make) -> list[ToolCall] | None:
    """make(match) of every match, or None where there is none or one of them is not a call."""
    if not matches:
        return None
    calls = [make(m) for m in matches]
    return None if any(c is None for c in calls) else calls


def _xml_value(raw: str) -> Any:
    """A glm45/minimax argument value: the JSON value it spells unless that is a string, else the text as written."""
    try:
        value = _loads(raw)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value


def _repeated(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Matches of `pattern` tiling all of `text` (whitespace allowed around them); None where anything else is left."""
    matches, pos = [], 0
    while True:
        m = pattern.match(text, pos)
        if m is None or m.end() == pos:
            break
        matches.append(m)
        pos = m.end()
    return matches if not text[pos:].strip() else None


class ToolStream:
    """Incremental splitter for one answer: push() generated text as it comes, finish() at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._buf = ""  # held-back text, or the open section from its start marker on
        self._start: str | None = None  # the open section's start marker
        self._scan = 0  # where in _buf to look for the section's end marker next

    def push(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._start is None:
                if not self._open_section(events):
                    break
            elif not self._close_section(events):
                break
        return _merged(events)

    def finish(self) -> list[Event]:
        # Whatever is left is a held-back tail or an unterminated section: both are plain text.
        events: list[Event] = [("text", self._buf)] if self._buf else []
        self._buf, self._start, self._scan = "", None, 0
        return events

    def _open_section(self, events: list[Event]) -> bool:
        """Emit text up to the first start marker and open its section (True); else emit all but a marker prefix."""
        found: tuple[int, int, str] | None = None
        for marker in self.parser.start_markers:
            i = self._buf.find(marker)
            # Earliest marker wins; at the same place the longer one (it contains the shorter).
            if i >= 0 and (found is None or (i, -len(marker)) < found[:2]):
                found = (i, -len(marker), marker)
        if found is not None:
            i, _, marker = found
            if i:
                events.append(("text", self._buf[:i]))
            self._buf, self._start, self._scan = self._buf[i:], marker, len(marker)
            return True
        hold = held_prefix(self._buf, self.parser.start_markers)
        cut = len(self._buf) - hold
        if cut:
            events.append(("text", self._buf[:cut]))
            self._buf = self._buf[cut:]
        return False

    def _close_section(self, events: list[Event]) -> bool:
        """Parse and emit the open section once its end marker has arrived (True); else keep buffering."""
        assert self._start is not None
        end = self.parser.end_marker
        j = self._buf.find(end, self._scan)
        if j < 0:
            # The end marker may straddle this push and the next: rescan only its possible start.
            self._scan = max(len(self._start), len(self._buf) - len(end) + 1)
            return False
        stop = j + len(end)
        section, self._buf = self._buf[:stop], self._buf[stop:]
        calls = self.parser.parse_section(section[len(self._start):j])
        if calls:
            events.extend(("tool_call", call) for call in calls)
        else:
            events.append(("text", section))
        self._start, self._scan = None, 0
        return True


def _merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for kind, value in events:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", str(out[-1][1]) + str(value))
        else:
            out.append((kind, value))
    return out


class ToolParser:
    """One model's tool-call format. Subclasses set the markers and parse a section's body."""

    name: str = ""
    start_markers: tuple[str, ...] = ()
    end_marker: str = ""

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole answer at once: (the text outside calls, the calls)."""
        stream = self.stream()
        events = stream.push(text) + stream.finish()
        plain = "".join(str(v) for k, v in events if k == "text")
        return plain, [v for k, v in events if k == "tool_call" and isinstance(v, ToolCall)]

    def parse_section(self, body: str) -> list[ToolCall] | None:
        """The calls in the text between a start and an end marker; None (or []) where it does not parse."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per section (Qwen, Hermes)."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def parse_section(self, body: str) -> list[ToolCall] | None:
        try:
            obj = _loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        # Some fine-tunes write "parameters"; a call with neither key takes no arguments.
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
        call = _call(obj.get("name"), args)
        return [call] if call else None


class DeepSeekV3Parser(ToolParser):
    """DeepSeek-V3/R1 (`function<sep>NAME` then a ```json fence) and V3.1 (`NAME<sep>JSON`) calls in one section."""

    name = "deepseek_v3"
    start_markers = ("<｜tool▁calls▁begin｜>",)
    end_marker = "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>\s*", re.S)
    # V3's right side: the function name on its own line, then the arguments in a code fence.
    _FENCED = re.compile(r"\A([^\n`]*)\n?```[A-Za-z]*[ \t]*\n(.*?)\n?[ \t]*```\s*\Z", re.S)

    def parse_section(self, body: str) -> list[ToolCall] | None:
        return _every_call(_repeated(self._CALL, body), self._one)

    def _one(self, m: re.Match) -> ToolCall | None:
        left, right = m.group(1), m.group(2)
        fenced = self._FENCED.match(right.lstrip())
        if fenced:  # (a fence after a bare name, no `function` line, still names the call on the left)
            return _call(fenced.group(1).strip() or left, fenced.group(2))
        return _call(left, right)


class KimiK2Parser(ToolParser):
    """`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>JSON<|tool_call_end|>` calls."""

    name = "kimi_k2"
    start_markers = ("<|tool_calls_section_begin|>",)
    end_marker = "<|tool_calls_section_end|>"
    _CALL = re.compile(r"\s*<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
                       re.S)
    _ID = re.compile(r"\A\s*(?:functions\.)?(.+?)(?::\d+)?\s*\Z", re.S)

    def parse_section(self, body: str) -> list[ToolCall] | None:
        return _every_call(_repeated(self._CALL, body), self._one)

    def _one(self, m: re.Match) -> ToolCall | None:
        ident = self._ID.match(m.group(1))
        return _call(ident.group(1), m.group(2)) if ident else None


class Glm45Parser(ToolParser):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>` (GLM-4.5/4.6)."""

    name = "glm45"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    _ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)

    def parse_section(self, body: str) -> list[ToolCall] | None:
        i = body.find("<arg_key>")
        name, rest = (body[:i], body[i:]) if i >= 0 else (body, "")
        args = _repeated(self._ARG, rest)
        if args is None:
            return None
        call = _call(name, {m.group(1).strip(): _xml_value(m.group(2)) for m in args})
        return [call] if call else None


class MiniMaxM2Parser(ToolParser):
    """`<minimax:tool_call><invoke name="N"><parameter name="K">V</parameter>...</invoke>...</minimax:tool_call>`."""

    name = "minimax_m2"
    start_markers = ("<minimax:tool_call>",)
    end_marker = "</minimax:tool_call>"
    _INVOKE = re.compile(r"\s*<invoke\s+name=([\"'])(.*?)\1\s*>(.*?)</invoke>\s*", re.S)
    _PARAM = re.compile(r"\s*<parameter\s+name=([\"'])(.*?)\1\s*>(.*?)</parameter>\s*", re.S)

    def parse_section(self, body: str) -> list[ToolCall] | None:
        return _every_call(_repeated(self._INVOKE, body), self._one)

    def _one(self, invoke: re.Match) -> ToolCall | None:
        params = _repeated(self._PARAM, invoke.group(3))
        if params is None:
            return None
        return _call(invoke.group(2), {p.group(2): _xml_value(p.group(3)) for p in params})


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, DeepSeekV3Parser, KimiK2Parser, Glm45Parser, MiniMaxM2Parser)}

# Checked in this order: GLM's templates also hold `<tool_call>`, so `<arg_key>` must come first.
_TEMPLATE_MARKERS = (
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<arg_key>", "glm45"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<tool_call>", "hermes"),
)

_MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3",
    "kimi_k2": "kimi_k2",
    "glm4_moe": "glm45",
    "minimax_m2": "minimax_m2",
    "qwen3_moe": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen2": "hermes",
}


def parser_named(name: str) -> ToolParser:
    """The parser for a format name; ValueError listing the valid names."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; valid formats: {', '.join(PARSERS)}") from None


def parser_for(chat_template: str | None, model_type: str | None = None) -> ToolParser | None:
    """The parser a model's chat template (first) or config.model_type implies; None where neither tells."""
    if chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template:
                return PARSERS[name]()
    if model_type and model_type in _MODEL_TYPES:
        return PARSERS[_MODEL_TYPES[model_type]]()
    return None
