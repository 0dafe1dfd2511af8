"""Tool-call parsers (ktransformers.server.toolcalls): each format's realistic outputs parsed whole,
streamed a character at a time and in random chunks; malformed sections coming back as text; marker
prefixes held back only while they could still start a call; and choosing a parser."""
from __future__ import annotations

import json
import random
import re

import pytest

from ktransformers.server.toolcalls import ToolCall, parser_for, parser_named

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARG, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

NESTED = {"query": {"filters": [{"field": "tag", "op": "in", "values": ["a", "b"]}], "limit": 5},
          "note": 'he said "hi" } and {', "city": "Zürich 東京 🌍"}


def hermes(name, args, as_string=False):
    a = json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(a) if as_string else a}}}\n</tool_call>'


def ds_v3(name, args):
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```{DS_END}"


def ds_v31(name, args):
    return f"{DS_CALL}{name}{DS_SEP}{json.dumps(args, ensure_ascii=False)}{DS_END}"


def kimi(name, args, index):
    return f"{K_CALL}functions.{name}:{index}{K_ARG}{json.dumps(args, ensure_ascii=False)}{K_END}"


# (format, model output, expected text, expected [(name, arguments)])
CASES = [
    ("hermes", hermes("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    ("hermes", "Let me check.\n\n" + hermes("get_weather", {"city": "Paris"}) + "\nOne moment.",
     "Let me check.\n\n\nOne moment.", [("get_weather", {"city": "Paris"})]),
    ("hermes", hermes("search", NESTED) + "\n" + hermes("get_time", {"tz": "UTC"}, as_string=True),
     "\n", [("search", NESTED), ("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [("now", {})]),
    ("deepseek_v3", f"I'll look.{DS_CALLS}{ds_v3('get_weather', {'city': 'Paris'})}{DS_CALLS_END}",
     "I'll look.", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", f"{DS_CALLS}{ds_v3('search', NESTED)}\n{ds_v3('get_time', {'tz': 'UTC'})}{DS_CALLS_END}Done.",
     "Done.", [("search", NESTED), ("get_time", {"tz": "UTC"})]),
    ("deepseek_v3", f"a<b{DS_CALLS}{ds_v31('get_weather', {'city': 'Paris'})}{ds_v31('search', NESTED)}{DS_CALLS_END}",
     "a<b", [("get_weather", {"city": "Paris"}), ("search", NESTED)]),
    ("kimi_k2", f"Checking.{K_SEC}{kimi('get_weather', {'city': 'Paris'}, 0)}{K_SEC_END}",
     "Checking.", [("get_weather", {"city": "Paris"})]),
    ("kimi_k2", f"{K_SEC}{kimi('search', NESTED, 0)}\n{kimi('get_time', {'tz': 'UTC'}, 1)}{K_SEC_END} ok",
     " ok", [("search", NESTED), ("get_time", {"tz": "UTC"})]),
    ("glm45", "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "Sure.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    ("glm45", "<tool_call>configure\n<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n"
              "<arg_key>dry_run</arg_key>\n<arg_value>true</arg_value>\n<arg_key>limit</arg_key>\n"
              "<arg_value>null</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, \"}\"]}</arg_value>\n"
              "<arg_key>tags</arg_key>\n<arg_value>[\"x\", \"ü\"]</arg_value>\n<arg_key>quoted</arg_key>\n"
              "<arg_value>\"kept\"</arg_value>\n<arg_key>text</arg_key>\n<arg_value>Zürich } \"q\"</arg_value>\n"
              "</tool_call>\n<tool_call>now\n</tool_call> after",
     "\n after", [("configure", {"ratio": 0.5, "dry_run": True, "limit": None, "opts": {"a": [1, "}"]},
                                 "tags": ["x", "ü"], "quoted": '"kept"', "text": 'Zürich } "q"'}), ("now", {})]),
    ("minimax_m2", 'Let me see.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
                   '</minimax:tool_call>',
     "Let me see.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="search">\n<parameter name="q">東京 "ramen" }</parameter>\n'
                   '<parameter name="filters">{"open": true, "price": [1, 2]}</parameter>\n'
                   '<parameter name="strict">false</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n'
                   '</minimax:tool_call>\nThen more.',
     "\nThen more.", [("search", {"q": '東京 "ramen" }', "filters": {"open": True, "price": [1, 2]}, "strict": False}),
                      ("now", {})]),
]


def collect(events):
    """(concatenated text, [(name, parsed arguments)]) from stream events, checking each call's shape."""
    text, calls = "", []
    for kind, value in events:
        if kind == "text":
            assert isinstance(value, str)
            text += value
        else:
            assert kind == "tool_call" and isinstance(value, ToolCall)
            assert re.fullmatch(r"call_[0-9a-f]{24}", value.id)
            args = json.loads(value.arguments)
            assert isinstance(args, dict)
            calls.append((value.name, args))
    return text, calls


def streamed(fmt, chunks):
    stream = parser_named(fmt).stream()
    events = []
    for chunk in chunks:
        events += stream.push(chunk)
    return collect(events + stream.finish())


def random_chunks(text, rng):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i:i + n])
        i += n
    return out


def assert_all_ways(fmt, text, expected):
    """Whole parse, one push, a character at a time and random chunks all give `expected`."""
    plain, calls = parser_named(fmt).parse(text)
    assert (plain, [(c.name, json.loads(c.arguments)) for c in calls]) == expected
    assert streamed(fmt, [text]) == expected
    assert streamed(fmt, list(text)) == expected
    rng = random.Random(1234)
    for _ in range(5):
        assert streamed(fmt, random_chunks(text, rng)) == expected


@pytest.mark.parametrize("fmt,text,want_text,want_calls", CASES)
def test_realistic_outputs(fmt, text, want_text, want_calls):
    assert_all_ways(fmt, text, (want_text, want_calls))


@pytest.mark.parametrize("fmt", sorted({c[0] for c in CASES}))
def test_cases_of_a_format_joined_with_text(fmt):
    """All of a format's cases in one answer, with text between: the sections follow one another cleanly."""
    cases = [c for c in CASES if c[0] == fmt]
    text = " | ".join(c[1] for c in cases)
    want_text = " | ".join(c[2] for c in cases)
    want_calls = [call for c in cases for call in c[3]]
    assert_all_ways(fmt, text, (want_text, want_calls))


def test_ids_are_unique_and_arguments_are_json_text():
    _, calls = parser_named("hermes").parse(hermes("f", {"s": "é"}) + hermes("f", {"s": "é"}))
    assert len({c.id for c in calls}) == 2
    assert calls[0].arguments == '{"s": "é"}'  # ensure_ascii=False


MALFORMED = [
    ("hermes", 'x <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> y'),  # bad JSON
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),  # not JSON once re-serialized
    ("hermes", 'text <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'),  # unterminated
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "</tool_call>"),  # too deep for json
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": }}\n```{DS_END}{DS_CALLS_END}"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}{DS_SEP}{{\"a\": 1}}{DS_END}{DS_CALLS_END}"),  # no name
    ("deepseek_v3", f"{DS_CALLS}junk{DS_CALLS_END}"),  # no call inside
    ("deepseek_v3", f"{DS_CALLS}{ds_v31('f', {'a': 1})} stray {ds_v31('g', {})}{DS_CALLS_END}"),
    ("deepseek_v3", f"ok {DS_CALLS}{ds_v31('f', {'a': 1})}"),  # unterminated
    ("kimi_k2", f"{K_SEC}{K_CALL}functions.f:0{K_ARG}{{bad}}{K_END}{K_SEC_END}"),
    ("kimi_k2", f"{K_SEC}{K_CALL}{K_ARG}{{}}{K_END}{K_SEC_END}"),  # no name
    ("kimi_k2", f"{K_SEC}{K_CALL}functions.f:0{{\"a\": 1}}{K_END}{K_SEC_END}"),  # no argument marker
    ("kimi_k2", f"{K_SEC}{kimi('f', {'a': 1}, 0)}"),  # unterminated
    ("glm45", "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),  # no name
    ("glm45", "<tool_call>f\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>"),  # unclosed value
    ("glm45", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'),  # hermes JSON is not glm45
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"),  # unterminated
    ("minimax_m2", '<minimax:tool_call>\n<invoke>\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", "<minimax:tool_call>\nnothing here\n</minimax:tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke>'),
]


@pytest.mark.parametrize("fmt,text", MALFORMED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MALFORMED)])
def test_malformed_sections_come_back_as_text(fmt, text):
    assert_all_ways(fmt, text, (text, []))


def test_a_value_too_deep_for_json_is_kept_as_a_string():
    deep = "[" * 100_000
    text = f"<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{deep}</arg_value>\n</tool_call>"
    _, calls = parser_named("glm45").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": deep})]


def test_good_section_after_a_bad_one_still_parses():
    bad = '<tool_call>\n{"name": "f", oops}\n</tool_call>'
    text = bad + " then " + hermes("g", {"b": [1]})
    assert_all_ways("hermes", text, (bad + " then ", [("g", {"b": [1]})]))


MENTIONS = [
    ("hermes", "To call a tool, use <tool"),
    ("hermes", "if a < b and b > c then <tool_call"),
    ("hermes", "the tag is </tool_call> alone"),  # an end marker without a start is plain text
    ("deepseek_v3", f"a < b, and {DS_CALL}x{DS_END} outside a section, then <｜tool▁calls"),
    ("kimi_k2", "<|tool_calls_section"),
    ("glm45", "x <arg_key>k</arg_key> and <tool_"),
    ("minimax_m2", "<minimax:tool"),
]


@pytest.mark.parametrize("fmt,text", MENTIONS)
def test_mentions_of_a_marker_are_plain_text(fmt, text):
    assert_all_ways(fmt, text, (text, []))


def test_only_a_possible_marker_prefix_is_held_back():
    stream = parser_named("hermes").stream()
    assert collect(stream.push("Hello <tool")) == ("Hello ", [])
    assert collect(stream.push("s are fun <")) == ("<tools are fun ", [])
    assert collect(stream.push("tool_call>\n{\"name\": \"f\", ")) == ("", [])
    assert collect(stream.push('"arguments": {}}\n</tool_call')) == ("", [])
    assert collect(stream.push(">!")) == ("!", [("f", {})])
    assert stream.finish() == []


def test_no_part_of_a_marker_that_begins_a_call_is_emitted():
    for fmt, text, want_text, _ in CASES:
        stream = parser_named(fmt).stream()
        emitted = "".join(str(v) for c in text for k, v in stream.push(c) if k == "text")
        emitted += "".join(str(v) for k, v in stream.finish() if k == "text")
        assert emitted == want_text, fmt


def test_finish_flushes_the_held_tail():
    stream = parser_named("minimax_m2").stream()
    assert stream.push("a <minimax:") == [("text", "a ")]
    assert stream.finish() == [("text", "<minimax:")]


@pytest.mark.parametrize("template,model_type,expected", [
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}", None, "deepseek_v3"),
    ("{{ '<|tool_calls_section_begin|>' }}{% for t in tool_calls %}", "deepseek_v3", "kimi_k2"),
    ("<tool_call>{{ tc.name }}\n{% for k, v in args %}<arg_key>{{ k }}</arg_key>", None, "glm45"),
    ('<minimax:tool_call>\n<invoke name="{{ tc.name }}">', None, "minimax_m2"),
    ('<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}', None, "hermes"),
    ("{{ messages }}", "deepseek_v2", "deepseek_v3"),
    (None, "deepseek_v3", "deepseek_v3"),
    (None, "kimi_k2", "kimi_k2"),
    ("", "glm4_moe", "glm45"),
    (None, "minimax_m2", "minimax_m2"),
    (None, "qwen3_moe", "hermes"),
    (None, "qwen2", "hermes"),
])
def test_parser_for(template, model_type, expected):
    parser = parser_for(template, model_type)
    assert parser is not None and parser.name == expected


def test_parser_for_unknown_is_none():
    assert parser_for("{{ messages }}", "llama") is None
    assert parser_for(None) is None


def test_parser_named():
    for name in ("hermes", "deepseek_v3", "kimi_k2", "glm45", "minimax_m2"):
        parser = parser_named(name)
        assert parser.name == name and parser.start_markers
    with pytest.raises(ValueError) as err:
        parser_named("qwen")
    assert "'qwen'" in str(err.value)
    for name in ("hermes", "deepseek_v3", "kimi_k2", "glm45", "minimax_m2"):
        assert name in str(err.value)
