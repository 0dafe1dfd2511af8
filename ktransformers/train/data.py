"""Chat datasets for fine-tuning: JSONL records rendered through the model's chat template, with
the loss on the assistant's tokens only.

Each line is one JSON object, in one of the shapes fine-tuning tools write:
- {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]} (OpenAI's);
- {"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]} (ShareGPT's);
- {"prompt": "...", "completion": "..."} (one exchange; "response" or "output" for "completion").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

IGNORE = -100  # the label of a token that is not learned (transformers' cross-entropy skips it)
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # the token itself where it is learned, else IGNORE

    @property
    def learned(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def jsonl_records(path: str | os.PathLike):
    """(where, record) of each non-empty line of a JSONL file, `where` its "file:line"; a line
    that is not JSON is a ValueError naming it."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None


def read_records(path: str | os.PathLike) -> list[tuple[str, list[dict]]]:
    """(where, messages) of each non-empty line of a JSONL file; a ValueError names the file and
    line of a record that is not JSON or not one of the shapes above."""
    out = [(where, to_messages(record, where)) for where, record in jsonl_records(path)]
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def to_messages(record, where: str) -> list[dict]:
    """The record as a list of {"role", "content"} messages with at least one assistant turn."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "conversations" in record:
        messages = []
        for turn in record["conversations"] if isinstance(record["conversations"], list) else [None]:
            if not isinstance(turn, dict) or turn.get("from") not in _SHAREGPT_ROLES:
                raise ValueError(f"{where}: a ShareGPT turn needs 'from' in {sorted(_SHAREGPT_ROLES)} and 'value'")
            messages.append({"role": _SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
    elif "prompt" in record:
        answer = next((record[k] for k in ("completion", "response", "output") if k in record), None)
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    else:
        raise ValueError(f"{where}: expected 'messages', 'conversations' or 'prompt' + 'completion', got keys "
                         f"{sorted(record)}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} needs a string 'role' and a string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to learn")
    return messages


def render(tokenizer, messages: list[dict], where: str, max_len: int) -> Example:
    """The conversation through the tokenizer's chat template; the labels keep exactly the
    characters each assistant turn adds to the text (its answer and end-of-turn marker), found
    by rendering the conversation up to each turn, so any template works that renders earlier
    turns the same way whatever follows them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: pass --model_path with one, or a GGUF that holds "
                         "tokenizer.chat_template")
    spans, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (full.startswith(prompt) and prompt.startswith(done)):
            raise ValueError(f"{where}: the chat template renders earlier turns differently once the assistant's "
                             f"message {i} follows, so its tokens cannot be told apart; such templates (ones that drop "
                             "earlier reasoning, say) need one assistant turn per record")
        spans.append((len(prompt), len(full)))
        done = full
    encoded = tokenizer(done, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])[:max_len]
    labels = []
    for token, (start, end) in zip(ids, encoded["offset_mapping"]):
        inside = any(a <= start < b for a, b in spans) and end > start
        labels.append(token if inside else IGNORE)
    return Example(ids, labels)


def load_examples(path: str | os.PathLike, tokenizer, max_len: int) -> list[Example]:
    """Every record of a JSONL file rendered (render), skipping none; a record with nothing left to
    learn after truncation to max_len is a ValueError naming it."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    out = []
    for where, messages in read_records(path):
        example = render(tokenizer, messages, where, max_len)
        if example.learned == 0:
            raise ValueError(f"{where}: no assistant token within the first {max_len} tokens (raise --max_len)")
        out.append(example)
    return out
