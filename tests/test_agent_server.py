"""The server for agents, on loopback with the bundled demo model, through the official openai,
anthropic and ollama clients: tool round trips (plain and streamed), forced tool calls and
structured output whose JSON validates (jsonschema) where the model's own output does not, a
constrained request inside a batch of unconstrained ones, the reasoning split of a thinking
template, Anthropic's Messages API, /metrics (prometheus-client's parser) and the request log.
The demo model is a base LM: `--chat_template` gives it a thinking template that offers tools
in the Hermes format."""
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="structured output needs llguidance")
from test_server import Running  # noqa: E402

from ktransformers.server.chat import Answer  # noqa: E402
from ktransformers.server.reasoning import ThinkSplitter, split_reasoning  # noqa: E402
from ktransformers.server.toolcalls import ToolCall, parser_named  # noqa: E402

# A thinking template offering tools in the Hermes format (written for these tests): the answer
# starts inside <think> unless enable_thinking is false.
TEMPLATE = """\
{%- if tools %}system: You may call these functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
{% endif %}
{%- for m in messages %}{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}\
{% else %}{{ m.content }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}<think>
</think>
{% else %}<think>
{% endif %}{% endif %}"""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string",
                                                                                  "maxLength": 16}}}}}]
GREEDY = {"temperature": 0}  # (through extra_body: the anthropic client has no temperature argument of its own)
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(TEMPLATE)
    s = Running("--max_batch_size", "8", "--chat_template", str(path))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    s = Running("--max_batch_size", "8")
    yield s
    s.stop()


def valid(args: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(args), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_tool_round_trip_plain_and_streamed(agent):
    """A forced call of get_weather, its result sent back, and the final answer, with and
    without streaming (the official client assembles the streamed call)."""
    c = agent.client
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = c.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                      max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and valid(call.function.arguments, WEATHER)
    with c.chat.completions.stream(model="demo", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                   max_tokens=60) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed.message.tool_calls] == \
        [(call.function.name, json.loads(call.function.arguments))]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high_c": 21}'}]
    final = c.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                      temperature=0, max_tokens=24,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    chunks = c.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=24, stream=True,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer.message.content


def test_required_tool_calls_validate_where_free_output_does_not(agent):
    c = agent.client
    free = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=40,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not valid(free.choices[0].message.content or "", WEATHER)  # (the demo model writes prose)
    forced = c.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=80)
    calls = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[calls[0].function.name]
    assert valid(calls[0].function.arguments, schema)


def test_json_schema_alone_and_in_a_mixed_batch_of_eight(plain):
    """Constrained requests validate, at batch 1 and among unconstrained ones decoded in the same
    steps, and the unconstrained ones answer as they do alone (the masks stay in their rows)."""
    c = plain.client
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}

    def ask(i, constrained):
        kw = {"response_format": fmt} if constrained else {}
        r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": f"Forecast {i}:"}],
                                      temperature=0, max_tokens=40, **kw)
        return r.choices[0].message.content

    alone = [ask(i, i % 2 == 0) for i in range(8)]
    assert all(valid(alone[i], WEATHER) for i in range(0, 8, 2))
    assert not any(valid(alone[i], WEATHER) for i in range(1, 8, 2))
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(i, i % 2 == 0), range(8)))
    assert all(valid(together[i], WEATHER) for i in range(0, 8, 2))
    assert [together[i] for i in range(1, 8, 2)] == [alone[i] for i in range(1, 8, 2)]
    obj = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "JSON:"}], temperature=0,
                                    max_tokens=60, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # (a free-form object may run past max_tokens)
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    bad = httpx.post(plain.url + "/v1/chat/completions", json={
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and "schema" in bad.json()["error"]["message"]


def test_reasoning_is_split_from_the_answer(agent):
    c = agent.client
    thinking = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=24)
    message = thinking.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert reasoning and not message.content  # (the demo model never closes the block)
    parts = {"reasoning_content": [], "content": []}
    for chunk in c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=24, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            for key in parts:
                piece = getattr(delta, key, None) or (delta.model_extra or {}).get(key)
                if piece:
                    parts[key].append(piece)
    assert "".join(parts["reasoning_content"]) == reasoning and not "".join(parts["content"])
    answer = c.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=24,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].message.content and not answer.choices[0].message.model_extra.get("reasoning_content")


def test_anthropic_messages_tools_streaming_and_count(agent):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=agent.url, api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    off = {"type": "disabled"}
    plain = client.messages.create(model="demo", max_tokens=24, messages=ask, extra_body=GREEDY, thinking=off)
    assert plain.stop_reason == "max_tokens" and plain.content[0].type == "text" and plain.content[0].text
    with client.messages.stream(model="demo", max_tokens=24, messages=ask, extra_body=GREEDY, thinking=off) as stream:
        assert stream.get_final_message().content[0].text == plain.content[0].text
    text = plain.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # (a piece of the greedy answer: it stops there)
    cut = client.messages.create(model="demo", max_tokens=24, messages=ask, extra_body=GREEDY, thinking=off,
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    forced = client.messages.create(model="demo", max_tokens=80, messages=ask, tools=tools, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    use = [b for b in forced.content if b.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and len(use) == 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER)
    with client.messages.stream(model="demo", max_tokens=80, messages=ask, tools=tools, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use[0].name, use[0].input)]
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in forced.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                   "content": "sunny, 21 C"}]}]
    reply = client.messages.create(model="demo", max_tokens=16, messages=history, tools=tools, extra_body=GREEDY,
                                   thinking=off, tool_choice={"type": "none"})
    assert [b.type for b in reply.content] == ["text"]
    thought = client.messages.create(model="demo", max_tokens=16, messages=ask, extra_body=GREEDY)
    assert thought.content[0].type == "thinking" and thought.content[0].thinking
    count = client.messages.count_tokens(model="demo", messages=ask, thinking=off)
    assert count.input_tokens == plain.usage.input_tokens > 0


def test_api_key_as_x_api_key():
    anthropic = pytest.importorskip("anthropic")
    s = Running("--api_key", "sesame")
    try:
        ask = [{"role": "user", "content": "Hi"}]
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model="demo", max_tokens=4, messages=ask)
        reply = anthropic.Anthropic(base_url=s.url, api_key="sesame", max_retries=0).messages.create(
            model="demo", max_tokens=4, messages=ask)
        assert reply.usage.output_tokens == 4
        assert httpx.get(s.url + "/metrics").status_code == 401
    finally:
        s.stop()


def test_metrics_parse_and_count_requests(plain, caplog):
    parser = pytest.importorskip("prometheus_client.parser")

    def samples():
        text = httpx.get(plain.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in parser.text_string_to_metric_families(text) for s in family.samples}

    before = samples()
    with caplog.at_level(logging.INFO, logger="ktransformers.server"):
        r = plain.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "The list"}],
                                                 temperature=0, max_tokens=7)
    after = samples()
    key = ("kt_requests_total", (("api", "openai"), ("finish_reason", "length")))
    assert after[key] - before.get(key, 0) == 1
    assert after[("kt_generation_tokens_total", ())] - before.get(("kt_generation_tokens_total", ()), 0) == 7
    assert after[("kt_prompt_tokens_total", ())] - before.get(("kt_prompt_tokens_total", ()), 0) == \
        r.usage.prompt_tokens
    assert after[("kt_time_to_first_token_seconds_count", ())] > before.get(("kt_time_to_first_token_seconds_count", ()), 0)
    assert ("kt_requests_waiting", ()) in after and 0 <= after[("kt_kv_cache_usage_ratio", ())] <= 1
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "ktransformers.server"]
    assert any("7 generated" in line and "finish length" in line for line in lines), lines


def test_ollama_client_format_think_and_show(agent):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=agent.url)
    options = {"temperature": 0, "num_predict": 40}
    formatted = client.chat(model="demo", messages=ASK, format=WEATHER, options=options, think=False)
    jsonschema.validate(json.loads(formatted.message.content), WEATHER)
    thought = client.chat(model="demo", messages=ASK, options={"temperature": 0, "num_predict": 16}, think=True)
    assert thought.message.thinking and not thought.message.content
    shown = client.show("demo")
    assert shown.modelinfo["deepseek_v3.context_length"] == agent.scheduler.context_length
    assert "tools" in shown.capabilities and "thinking" in shown.capabilities
    models = agent.client.models.list().data
    assert models[0].model_extra["context_length"] == agent.scheduler.context_length


# -- the answer's split, without a server ------------------------------------------------------
def test_think_splitter_streamed_equals_whole():
    text = "\n<think>\nweigh the options\n</think>\n\nThe answer is 4. A <think> later is text."
    want = split_reasoning(text)
    assert want == ("weigh the options\n", "The answer is 4. A <think> later is text.")
    for size in (1, 2, 5):
        s = ThinkSplitter()
        out = []
        for i in range(0, len(text), size):
            out += s.push(text[i:i + size])
        out += s.finish()
        assert ("".join(p for k, p in out if k == "reasoning"), "".join(p for k, p in out if k == "text")) == want
    assert split_reasoning("still thinking", inside=True) == ("still thinking", "")
    assert split_reasoning("no tags at all") == ("", "no tags at all")


def test_answer_reads_forced_calls_and_returns_bad_json_as_text():
    named = Answer(None, None, "get_weather")
    out = named.push("text", '{"city": "Paris", ') + named.push("text", '"days": 3}') + named.finish()
    assert [(k, p.name, json.loads(p.arguments)) for k, p in out] == [("tool_call", "get_weather",
                                                                       {"city": "Paris", "days": 3})]
    cut = Answer(None, None, "get_weather")
    assert cut.push("text", '{"city": "Par') + cut.finish() == [("text", '{"city": "Par')] and not cut.tool_calls
    required = Answer(None, None, "")
    out = required.push("text", '[{"name": "get_time", "arguments": {"city": "Oslo"}}]') + required.finish()
    assert [(p.name, json.loads(p.arguments)) for _, p in out] == [("get_time", {"city": "Oslo"})]
    free = Answer(ThinkSplitter(inside=True), parser_named("hermes"), None)
    out = free.push("text", "plan</think>Sure.<tool_call>{\"name\": \"get_time\", ") + \
        free.push("text", "\"arguments\": {\"city\": \"Rome\"}}</tool_call>") + free.finish()
    kinds = [(k, p if not isinstance(p, ToolCall) else p.name) for k, p in out]
    assert kinds == [("reasoning", "plan"), ("text", "Sure."), ("tool_call", "get_time")]
    harmony = Answer(None, None, None)
    out = harmony.push("reasoning", "think") + harmony.push("tool", ("get_time", '{"city":')) + \
        harmony.push("tool", ("get_time", ' "Rome"}')) + harmony.finish()
    assert [(k, p.name if isinstance(p, ToolCall) else p) for k, p in out] == [("reasoning", "think"),
                                                                                ("tool_call", "get_time")]
