"""gpt-oss's harmony format through openai-harmony: the o200k_base vocabulary file written from a
tokenizer, prompts, and answers split into channels. The real vocabulary comes from the
bpe-openai package (it ships o200k_base), standing in for a gpt-oss tokenizer."""
import io
import json

import pytest

from ktransformers.engine import harmony
from ktransformers.local_chat import stream_harmony

oh = pytest.importorskip("openai_harmony", reason="openai-harmony is not installed")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)


@pytest.fixture(scope="module")
def o200k():
    bpe = pytest.importorskip("bpe_openai", reason="bpe-openai (which ships o200k_base) is not installed")
    return bpe.get_encoding("o200k_base")


class ByteLevelVocab:
    """The part of a byte-level BPE tokenizer harmony_chat reads: o200k_base's tokens shown in
    GPT-2's byte alphabet, as a gpt-oss GGUF's tokenizer shows them, and harmony's specials."""

    def __init__(self, o200k, extra=("<|channel|>",)):
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        alphabet = bytes_to_unicode()
        self.pieces = ["".join(alphabet[b] for b in o200k.decode_single_token_bytes(r))
                       for r in range(harmony.O200K_BASE_TOKENS)] + list(extra)

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def get_vocab(self):
        return {p: i for i, p in enumerate(self.pieces)}


def test_vocabulary_file_is_o200k_base_or_nothing(o200k):
    data = harmony.o200k_base_file(o200k.decode_single_token_bytes)
    assert data is not None and data.startswith(b"IQ== 0\n")  # rank 0 is "!"
    wrong = harmony.o200k_base_file(lambda r: o200k.decode_single_token_bytes(r) + (b"x" if r == 7 else b""))
    assert wrong is None  # one token off: not the vocabulary openai-harmony expects
    assert harmony.o200k_base_file(lambda r: o200k.decode_single_token_bytes(r) if r < 10 else None) is None


def test_harmony_chat_renders_and_splits_channels(o200k, tmp_path):
    chat = harmony.harmony_chat(ByteLevelVocab(o200k), "high")
    assert (tmp_path / "ktransformers" / "tiktoken" / "o200k_base.tiktoken").is_file()
    enc = chat.encoding
    ids = chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                       {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}])
    text = enc.decode(ids)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "<|start|>assistant<|channel|>final<|message|>4.<|end|>" in text
    assert text.index("What is 2+2?") < text.index("And 3+3?")
    answer = enc.encode("<|channel|>analysis<|message|>Add three and three.<|end|><|start|>assistant"
                        "<|channel|>final<|message|>Six.<|return|>", allowed_special="all")
    assert answer[-1] in chat.stop_ids
    pieces = list(chat.parse(answer))
    assert "".join(p.text for p in pieces if p.channel == "analysis") == "Add three and three."
    assert "".join(p.text for p in pieces if p.channel == "final") == "Six."
    assert [p.channel for p in pieces] == sorted((p.channel for p in pieces), key=["analysis", "final"].index)


def test_local_chat_shows_reasoning_apart(o200k):
    chat = harmony.harmony_chat(ByteLevelVocab(o200k))

    class Answer:  # what Engine.generate returns, as far as stream_harmony reads it
        def token_ids(self):
            yield from chat.encoding.encode("<|channel|>analysis<|message|>Hmm, greet back.<|end|><|start|>assistant"
                                            "<|channel|>final<|message|>Hello!", allowed_special="all")
    out = io.StringIO()
    assert stream_harmony(Answer(), chat, out) == "Hello!"
    assert out.getvalue() == "Thinking: Hmm, greet back.\n\nAnswer: Hello!\n"

    class OffFormat:  # no header at all: shown as the answer rather than swallowed by the parser
        def token_ids(self):
            yield from chat.encoding.encode("Just text.")
    out = io.StringIO()
    assert stream_harmony(OffFormat(), chat, out) == "Just text." and out.getvalue() == "Answer: Just text.\n"


def test_other_vocabularies(o200k):
    class Plain:
        def get_vocab(self):
            return {"a": 0, "b": 1}
    assert harmony.harmony_chat(Plain()) is None  # not harmony's: the chat template serves it
    not_o200k = ByteLevelVocab(o200k)
    not_o200k.pieces[5] = "x"
    with pytest.raises(RuntimeError, match="not o200k_base"):
        harmony.harmony_chat(not_o200k)
    with pytest.raises(ValueError, match="reasoning effort"):
        harmony.HarmonyChat(None, "extreme")


def test_server_returns_the_final_channel_and_the_reasoning_apart(o200k):
    """A harmony model's chat: the prompt comes from openai-harmony, the answer's final channel is
    the message's content and its analysis channel `reasoning_content`, streamed as their own deltas."""
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    from fastapi.testclient import TestClient

    from ktransformers.server.app import create_app

    from types import SimpleNamespace

    from ktransformers.server.scheduler import _emit_channels

    class Scheduler:  # plays the scheduler's part: the answer's tokens through the request's harmony parser
        tokenizer, context_length, running, prompts = ByteLevelVocab(o200k), 4096, [], []
        engine = SimpleNamespace(config=SimpleNamespace(model_type="gpt_oss", vocab_size=201088))
        eos_ids, on_finish, answer = set(), [], ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant"
                                                 "<|channel|>final<|message|>Four.<|return|>")

        def submit(self, r):
            self.prompts.append(r.prompt_ids)
            self.encoding = r.harmony.encoding
            stream = r.harmony.stream()
            answer = r.harmony.encoding.encode(self.answer, allowed_special="all")
            assert answer[-1] in r.stop_ids
            for token in answer[:-1]:
                r.tokens.append(token)
                _emit_channels(r, stream.push(token))  # (r.emit: thread-safe, in order with "done" below)
            r.finish_reason = "stop"
            r.t_done = r.t_first = r.t_submit
            r.loop.call_soon_threadsafe(r.events.put_nowait, ("done", "stop"))

    scheduler = Scheduler()
    client = TestClient(create_app(scheduler, "gpt-oss"))
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "2+2?"}]}
    reply = client.post("/v1/chat/completions", json=body).json()
    message = reply["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    assert "<|start|>user<|message|>2+2?<|end|><|start|>assistant" in scheduler.encoding.decode(scheduler.prompts[0])
    events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json=body | {"stream": True})
              .text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content", "") for d in deltas) == "Four."
    bad = client.post("/v1/chat/completions", json={"model": "gpt-oss", "messages": [{"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and "tool message needs" in bad.json()["error"]["message"]
    # a call: a commentary message to functions.get_weather; the tools are declared to the model
    scheduler.answer = ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
                        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    reply = client.post("/v1/chat/completions", json=body | {"tools": tools}).json()["choices"][0]
    call = reply["message"]["tool_calls"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["reasoning_content"] == "Look it up."
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    prompt = scheduler.encoding.decode(scheduler.prompts[-1])
    assert "get_weather" in prompt and "namespace functions" in prompt
    # the call and its result sent back: the prompt carries both as harmony messages
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    client.post("/v1/chat/completions", json={"model": "gpt-oss", "messages": history, "tools": tools})
    prompt = scheduler.encoding.decode(scheduler.prompts[-1])
    assert "to=functions.get_weather" in prompt and "<|start|>functions.get_weather to=assistant" in prompt
