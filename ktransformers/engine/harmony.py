"""gpt-oss's harmony format, through the `openai-harmony` package: prompts rendered by it, answers
split by its streaming parser into channels (`analysis`: the reasoning, `final`: the answer).

openai-harmony reads the o200k_base vocabulary from a tiktoken file, which it would download. The
model's own tokenizer holds that vocabulary (its first 199,998 tokens are o200k_base's, by rank;
the rest, harmony's special tokens), so the file is written from it into
~/.cache/ktransformers/tiktoken (under $XDG_CACHE_HOME where set) and checked against the hash
openai-harmony expects: a tokenizer of another vocabulary gets None, and the chat template.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

O200K_BASE_TOKENS = 199_998
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
REASONING_EFFORTS = ("low", "medium", "high")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ktransformers" / "tiktoken"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the character a byte-level BPE shows for each byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {char: byte for byte, char in bytes_to_unicode().items()}


def o200k_base_file(token_bytes) -> bytes | None:
    """tiktoken's o200k_base file from `token_bytes(rank) -> bytes` for ranks below 199,998, or
    None when those are not o200k_base's tokens (the file's hash differs)."""
    try:
        data = "".join(f"{base64.b64encode(token_bytes(rank)).decode()} {rank}\n"
                       for rank in range(O200K_BASE_TOKENS)).encode()
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return data if hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256 else None


def tokenizer_bytes(tokenizer):
    """`token_bytes(rank)` of a byte-level BPE tokenizer (the GPT-2 alphabet, as GGUF files and
    HF's fast tokenizers show gpt-oss's tokens), or None when its vocabulary is too small. Its
    pieces are read at the first call (only where the vocabulary file is to be written)."""
    if tokenizer is None or len(tokenizer) < O200K_BASE_TOKENS:
        return None
    decoder, pieces = _byte_decoder(), []

    def token_bytes(rank: int) -> bytes:
        if not pieces:
            pieces.extend(tokenizer.convert_ids_to_tokens(list(range(O200K_BASE_TOKENS))))
        return bytes(decoder[c] for c in pieces[rank])
    return token_bytes


def load_encoding(token_bytes):
    """openai-harmony's gpt-oss encoding over the vocabulary `token_bytes` gives, or None where it
    is not o200k_base (openai-harmony must be installed)."""
    import openai_harmony
    if token_bytes is None:
        return None
    folder = cache_dir()
    path = folder / "o200k_base.tiktoken"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != O200K_BASE_SHA256:
        data = o200k_base_file(token_bytes)
        if data is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


@dataclass
class Piece:
    """Part of an answer: `channel` "analysis" (reasoning), "final" (the answer) or another of
    harmony's (e.g. "commentary" for tool calls), and its new text; `recipient` "functions.NAME"
    where the text is the arguments of a call of tool NAME."""
    channel: str
    text: str
    recipient: str | None = None


class HarmonyChat:
    """Prompts and answer parsing for one conversation in the harmony format."""

    def __init__(self, encoding, reasoning_effort: str = "medium"):
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
        self.encoding, self.reasoning_effort = encoding, reasoning_effort

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` ([{"role": "system"|"developer"|"user"|"assistant"|"tool",
        "content": str}], OpenAI's shape) ready for the assistant's answer; a system message's text
        goes to harmony's developer instructions, earlier assistant answers are their final
        channel, their `tool_calls` commentary messages to functions.NAME, and a tool message the
        answer of the function its `name` (or its tool_call_id's call) names. `tools`: OpenAI's
        function tools, declared in the developer message."""
        import openai_harmony as oh
        system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort(self.reasoning_effort.capitalize()))
        out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        instructions = "\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
        if instructions or tools:
            developer = oh.DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if tools:
                developer = developer.with_function_tools([
                    oh.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                           parameters=t["function"].get("parameters")) for t in tools])
            out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
        called: dict[str, str] = {}  # tool_call_id -> function name
        for m in messages:
            role, text = m["role"], m["content"]
            if role in ("system", "developer"):
                continue
            if role == "user":
                out.append(oh.Message.from_role_and_content(oh.Role.USER, text))
            elif role == "assistant":
                if text:
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("final"))
                for call in m.get("tool_calls") or ():
                    name = call["function"]["name"]
                    called[call.get("id", "")] = name
                    arguments = call["function"].get("arguments", "{}")
                    out.append(oh.Message.from_role_and_content(
                        oh.Role.ASSISTANT, arguments if isinstance(arguments, str) else json.dumps(arguments))
                        .with_channel("commentary").with_recipient(f"functions.{name}").with_content_type("json"))
            elif role == "tool":
                name = m.get("name") or called.get(m.get("tool_call_id") or "", "")
                if not name:
                    raise ValueError("a tool message needs the name of its function, or the tool_call_id of an "
                                     "earlier assistant tool call")
                out.append(oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, f"functions.{name}"), text)
                           .with_channel("commentary").with_recipient("assistant"))
            else:
                raise ValueError(f"harmony messages are system, developer, user, assistant or tool, not {role!r}")
        conversation = oh.Conversation.from_messages(out)
        return list(self.encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT))

    @property
    def stop_ids(self) -> set[int]:
        """Tokens that end the assistant's turn (<|return|>, <|call|>)."""
        return set(self.encoding.stop_tokens_for_assistant_actions())

    def parse(self, token_ids):
        """Pieces (channel, text) of the answer's tokens as they come."""
        stream = self.stream()
        for token in token_ids:
            yield from stream.push(token)
        yield from stream.finish()

    def stream(self) -> "HarmonyStream":
        return HarmonyStream(self.encoding)


class HarmonyStream:
    """One answer's tokens in, pieces (channel, text) out, one token at a time. An answer that
    never opens a message (no harmony header: a model off its format) comes as final text at its
    end rather than not at all."""

    def __init__(self, encoding):
        import openai_harmony as oh
        self.encoding = encoding
        self.parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT, strict=False)
        self.seen: list[int] = []
        self.any_content = False

    def push(self, token: int) -> list[Piece]:
        self.seen.append(int(token))
        self.parser.process(int(token))
        delta = self.parser.last_content_delta
        if not delta:
            return []
        self.any_content = True
        return [Piece(self.parser.current_channel or "final", delta, self.parser.current_recipient)]

    def finish(self) -> list[Piece]:
        if self.any_content:
            return []
        ordinary = [t for t in self.seen if t < O200K_BASE_TOKENS]  # (ids past the vocabulary: nothing to show)
        text = self.encoding.decode(ordinary) if ordinary else ""
        return [Piece("final", text)] if text else []


def harmony_chat(tokenizer, reasoning_effort: str = "medium") -> HarmonyChat | None:
    """The harmony format for a tokenizer of gpt-oss's vocabulary (it has <|channel|>), or None
    for other tokenizers. Raises RuntimeError where the vocabulary is gpt-oss's but openai-harmony
    cannot read it (not installed, or not o200k_base underneath)."""
    if tokenizer is None or "<|channel|>" not in tokenizer.get_vocab():
        return None
    try:
        import openai_harmony  # noqa: F401
    except ImportError:
        raise RuntimeError("this model speaks the harmony format (gpt-oss), which needs the openai-harmony "
                           "package: pip install openai-harmony") from None
    encoding = load_encoding(tokenizer_bytes(tokenizer))
    if encoding is None:
        raise RuntimeError("the tokenizer has harmony's <|channel|> token but its first 199,998 tokens are not "
                           "o200k_base's, which openai-harmony needs")
    return HarmonyChat(encoding, reasoning_effort)
