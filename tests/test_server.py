"""The server on loopback with the bundled demo model: the official openai client (chat,
completions, streaming, stop), Ollama-shaped requests, malformed ones, 16 concurrent greedy
streams equal to each alone, a disconnect that leaks no cache pages, prefix-cache reuse, 429."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from ktransformers.server.__main__ import build_parser, make_server, uvicorn_config  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, *flags):
        port = free_port()
        args = build_parser().parse_args(["--port", str(port), "--cache_lens", "4096", "--cpu_infer", "2",
                                          "--model_name", "demo", *flags])
        self.app, self.scheduler = make_server(args)
        self.server = uvicorn.Server(uvicorn_config(self.app, host="127.0.0.1", port=port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120  # (a hang guard)
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.scheduler.close()


@pytest.fixture(scope="module")
def srv():
    s = Running("--max_batch_size", "16")
    yield s
    s.stop()


def chat(srv, text, **kw):
    return srv.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": text}],
                                              temperature=0, **kw)


def test_openai_chat_and_completions(srv):
    r = chat(srv, "The Python tutorial", max_tokens=12)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    c = srv.client.completions.create(model="demo", prompt="A module is a file", max_tokens=10, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text and c.usage.completion_tokens <= 10
    models = srv.client.models.list()
    assert [m.id for m in models.data] == ["demo"]


def test_streaming_equals_non_streaming(srv):
    full = chat(srv, "Lists in Python", max_tokens=16).choices[0].message.content
    stream = chat(srv, "Lists in Python", max_tokens=16, stream=True, stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == full and reasons[-1] in ("stop", "length") and usage.completion_tokens > 0


def test_stop_strings_cut_the_text(srv):
    base = chat(srv, "The interpreter", max_tokens=24).choices[0].message.content
    cut = base.strip().split()[2] if len(base.split()) > 3 else None
    if cut is None:
        pytest.skip("the demo answer is too short to pick a stop word from")
    r = chat(srv, "The interpreter", max_tokens=24, stop=[cut])
    assert cut not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert base.startswith(r.choices[0].message.content)


def test_ollama_endpoints(srv):
    g = httpx.post(srv.url + "/api/generate", json={"model": "demo", "prompt": "Functions", "stream": False,
                                                     "options": {"temperature": 0, "num_predict": 8}}, timeout=60)
    body = g.json()
    assert g.status_code == 200 and body["done"] and body["response"] and body["eval_count"] <= 8
    with httpx.stream("POST", srv.url + "/api/chat", timeout=60, json={
            "model": "demo", "messages": [{"role": "user", "content": "Classes"}],
            "options": {"temperature": 0, "num_predict": 8}}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and lines[-1]["done_reason"] in ("stop", "length")
    assert "".join(x["message"]["content"] for x in lines) != ""
    tags = httpx.get(srv.url + "/api/tags").json()
    assert tags["models"][0]["name"] == "demo"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_malformed_requests_get_clear_errors(srv):
    bad_json = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    missing = httpx.post(srv.url + "/v1/chat/completions", json={"model": "demo"})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "messages"
    temp = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "temperature": -1})
    assert temp.status_code == 422 and "temperature" in temp.json()["error"]["message"]
    long = httpx.post(srv.url + "/v1/completions", json={"prompt": "word " * 100, "max_tokens": 5000})
    assert long.status_code == 400 and "exceed the context" in long.json()["error"]["message"]
    unknown = httpx.post(srv.url + "/v1/completions", json={"model": "gpt-x", "prompt": "a"})
    assert unknown.status_code == 404 and "gpt-x" in unknown.json()["error"]["message"]
    ollama = httpx.post(srv.url + "/api/generate", json={"prompt": 3})
    assert ollama.status_code == 422 and isinstance(ollama.json()["error"], str)
    seed = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "seed": 2**70})
    assert seed.status_code == 422 and seed.json()["error"]["param"] == "seed"
    full = httpx.post(srv.url + "/v1/completions", json={"prompt": "word " * 5000})  # no max_tokens
    assert full.status_code == 400 and full.json()["error"]["code"] == 400
    assert "no room in the context" in full.json()["error"]["message"]


def test_concurrent_greedy_streams_equal_alone(srv):
    prompts = [f"Topic {i}: the standard library" for i in range(16)]

    def run(p):
        out = chat(srv, p, max_tokens=16, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    alone = [run(p) for p in prompts[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together[:4] == alone
    assert all(together)


def test_disconnect_mid_stream_frees_the_pages(srv):
    sched = srv.scheduler
    pages = sched.engine.cache.num_pages
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 2000,
            "temperature": 0.8, "stream": True}) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(6)]  # a few events, then hang up
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 120  # (a hang guard: the disconnect is seen at the next token)
    while (sched.running or sched.free_pages() != pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sched.running and sched.free_pages() == pages


def test_prefix_cache_reuses_a_repeated_prompt(srv, monkeypatch):
    """The second request of a long prompt computes only its last token: counted in the prompt
    tokens the engine's prefill runs, and reported as cached in the usage."""
    text = " ".join(f"The section {i} of the tutorial covers data structures." for i in range(60))
    engine = srv.scheduler.engine
    prefilled, real_chunk = [], engine.prefill_chunk

    def counted_chunk(seq, prompt_ids, begin):
        logits, end = real_chunk(seq, prompt_ids, begin)
        prefilled[-1] += end - begin
        return logits, end
    monkeypatch.setattr(engine, "prefill_chunk", counted_chunk)

    def usage_of_one_request():
        prefilled.append(0)
        stream = srv.client.completions.create(model="demo", prompt=text, max_tokens=4, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
        return usage
    cold, warm = usage_of_one_request(), usage_of_one_request()
    assert cold.prompt_tokens > 500 and prefilled[0] == cold.prompt_tokens
    assert warm.prompt_tokens_details.cached_tokens == warm.prompt_tokens - 1
    assert prefilled[1] == 1


def test_full_queue_answers_429_and_api_key():
    """One running + one waiting fill a server of --max_batch_size 1 --max_queue 1: a third
    request at that time gets 429 (in OpenAI's error shape); the API key guards /v1."""
    s = Running("--max_batch_size", "1", "--max_queue", "1", "--api_key", "sekret")
    try:
        headers = {"Authorization": "Bearer sekret"}
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers=headers).status_code == 200
        body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3000, "temperature": 0.9,
                "stream": True, "ignore_eos": True}
        hang_up = threading.Event()
        statuses = []

        def client():
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
                statuses.append(r.status_code)
                if r.status_code == 200:
                    hang_up.wait(120)  # keep the request alive (running or waiting) until the 429 is seen
                else:
                    statuses.append(json.loads(r.read())["error"]["type"])
                    statuses.append(r.headers.get("retry-after"))
        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120  # (a hang guard)
        while 429 not in statuses and time.monotonic() < deadline:
            time.sleep(0.02)
        hang_up.set()
        for t in threads:
            t.join(timeout=60)
        assert statuses.count(429) == 1 and statuses.count(200) == 2 and "rate_limit_error" in statuses
        assert "1" in statuses  # Retry-After
    finally:
        s.stop()


def test_a_full_cache_queues_and_preempts_instead_of_cutting_short():
    """32 streams at --cache_lens 1024 (four 256-token pages), each wanting 300 tokens (two pages):
    requests wait for pages, running ones are preempted and resumed when decode runs short, and
    every one of them generates all its max_tokens (none cut short with finish_reason "length"
    early, none failing for want of pages)."""
    s = Running("--max_batch_size", "8", "--cache_lens", "1024")
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

        def stream(_):
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=600) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                return r.status_code, events
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(stream, range(32)))
        assert [status for status, _ in replies] == [200] * 32
        for _, events in replies:
            assert not any("error" in e for e in events), events[-1]
            assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "length"
            assert events[-1]["usage"]["completion_tokens"] == 300
        assert httpx.get(s.url + "/health").json()["engine"]["preemptions"] > 0
        s.scheduler.pool.clear()
        assert s.scheduler.free_pages() == 4  # all given back
    finally:
        s.stop()


def test_web_page_is_served(srv):
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "<form" in page.text


def test_web_page_chats_in_headless_chromium(srv):
    """The page at / in Debian's Chromium (headless, driven by Selenium): type, send, see the reply stream in."""
    import shutil
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(srv.url + "/")
        box = browser.find_element(By.ID, "input")
        box.send_keys("Tell me about Python lists")
        browser.find_element(By.ID, "send").click()
        reply = WebDriverWait(browser, 60).until(
            lambda b: b.find_element(By.CSS_SELECTOR, "#reply-1[data-done='1']"))
        assert reply.text.strip(), "the reply stayed empty"
        assert "Tell me about Python lists" in browser.find_element(By.ID, "log").text
    finally:
        browser.quit()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_prefix_pages_come_back_from_ram_and_disk(tmp_path, tier):
    """A small KV cache: other prompts push a finished request's sequence out; its full pages go to
    RAM (or, with no RAM budget, to disk) and a repeat of its prompt gets them back."""
    flags = ["--cache_lens", "1024", "--prefix_cache_dir", str(tmp_path)]
    flags += ["--prefix_cache_ram", "0"] if tier == "disk" else []
    s = Running(*flags)
    try:
        def ask(text):
            r = s.client.completions.create(model="demo", prompt=text, max_tokens=4, temperature=0)
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens
        a = " ".join(f"Paragraph {i} explains how the import system finds modules." for i in range(45))
        first, cached, n = ask(a)
        assert n > 512 and cached == 0
        for k in range(3):  # fill the 4 pages with other prompts: a's sequence is evicted
            ask(" ".join(f"Other {k}.{i}: classes and instances in detail." for i in range(45)))
        store = s.scheduler.pool.store
        assert len(store) >= 1
        again, cached, _ = ask(a)
        assert again == first and cached == 512  # two full pages of 256 back from the lower tier
        assert store.hits[tier] >= 1
        if tier == "disk":
            assert list(tmp_path.glob("*.pt"))
    finally:
        s.stop()


def test_prefix_pool_restore_failures_leak_nothing():
    """A stored prefix that cannot be imported, or a pooled sequence evicted while making room,
    leaves the pool and the cache consistent (no KeyError, no leaked pages)."""
    import torch

    from ktransformers.cache.prefix import PrefixStore
    from ktransformers.demo import DEMO_GGUF, DEMO_HF_DIR
    from ktransformers.engine.generate import Engine
    from ktransformers.loader import load_model
    from ktransformers.server.scheduler import PrefixPool
    lm = load_model(DEMO_GGUF, DEMO_HF_DIR, cpu_infer=2, progress=False)
    engine = Engine(lm.model, lm.tokenizer, cache_lens=512, page_size=16)
    store = PrefixStore(ram_bytes=1 << 30)
    pool = PrefixPool(engine, store=store)
    pages = engine.cache.num_pages
    prompt = list(range(5, 60))
    seq = engine.new_sequence()
    engine.prefill(seq, prompt[:20] + [3] * 30)  # shares 20 tokens with the prompt
    pool.put(seq)
    # a stored 48-token entry whose data does not fit this cache: the restore fails and falls back
    store.put(prompt[:48], [[torch.zeros(48, 3)] for _ in engine.cache.layers])
    taken = pool.take(prompt)
    assert taken is seq and len(engine.cache._free) + len(seq.pages) == pages  # no pages leaked
    engine.release(seq)
    # the pooled sequence evicted while making room: take() gives None, not a KeyError
    other = engine.new_sequence()
    engine.prefill(other, prompt[:20] + [4] * 30)
    pool.put(other)
    good = engine.cache.export_pages(other, 3)
    store.put(prompt[:48], good)
    engine.cache._free, hoard = engine.cache._free[:1], engine.cache._free[1:]  # almost no free pages left
    restored = pool.take(prompt)  # evicts `other` to make room, then restores the 48 stored tokens
    engine.cache._free += hoard
    assert restored is not None and restored is not other and restored.length == 48
    assert engine.cached_tokens(restored) == prompt[:48] and len(pool) == 0
    engine.release(restored)
    assert len(engine.cache._free) == pages


def test_bad_inputs_are_4xx_in_the_api_shape(srv):
    """Inputs that once gave a 500 or were accepted: an empty stop string, a content part whose
    text is a number, an infinite temperature (Ollama), a body over --max_request_mb (413, by its
    Content-Length and when chunked), all in each API's error shape."""
    msgs = [{"role": "user", "content": "hi"}]
    stop = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "stop": [""]})
    assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop"
    part = httpx.post(srv.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert part.status_code == 400 and "must be a string" in part.json()["error"]["message"]
    hot = httpx.post(srv.url + "/api/chat", content=b'{"messages": [{"role": "user", "content": "x"}], '
                     b'"stream": false, "options": {"temperature": Infinity}}', headers={"content-type": "application/json"})
    assert hot.status_code in (400, 422) and isinstance(hot.json()["error"], str)
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    too_big = httpx.post(srv.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and "larger than" in too_big.json()["error"]["message"]

    def chunks():
        for _ in range(20):
            yield b"a" * (1 << 20)
    chunked = httpx.post(srv.url + "/api/generate", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "larger than" in chunked.json()["error"]
    for body in (b'{"prompt": "\xff\xfe"}', b"[" * 5000 + b"]" * 5000):  # not UTF-8; nested too deep
        bad = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        bad = httpx.post(srv.url + "/api/generate", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
    missing = httpx.get(srv.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_taken_port_fails_before_the_model_loads():
    """The port is bound first: a taken one is a one-line error right away, the model never loaded."""
    import subprocess
    import sys
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "ktransformers.server", "--port", str(port),
                              "--gguf_path", "/nonexistent/model.gguf"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr, out.stderr
    assert "does not exist" not in out.stderr  # (the model path was never looked at)
    assert time.monotonic() - started < 60


def test_host_header_is_checked_on_loopback(srv):
    """On a loopback bind only the loopback names are answered (DNS rebinding: a page of another
    site whose name now resolves to 127.0.0.1); --allowed_hosts names others."""
    from ktransformers.server.__main__ import allowed_hosts
    from ktransformers.server.app import _host_name
    assert httpx.get(srv.url + "/health").status_code == 200
    for host in ("localhost:8080", "[::1]:10002", "127.0.0.1"):
        assert httpx.get(srv.url + "/health", headers={"host": host}).status_code == 200, host
    rebound = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, headers={"host": "evil.example:10002"})
    assert rebound.status_code == 421 and "evil.example" in rebound.json()["error"]["message"]
    assert httpx.get(srv.url + "/api/tags", headers={"host": "evil.example"}).json()["error"].startswith("Host")
    assert _host_name(b"[::1]:80") == "::1" and _host_name(b"Example.COM:1") == "example.com"
    parse = build_parser().parse_args
    assert allowed_hosts(parse(["--host", "0.0.0.0"])) is None
    assert allowed_hosts(parse(["--allowed_hosts", "chat.lan"])) == ("chat.lan",)


def test_a_slow_partial_body_times_out(srv, monkeypatch):
    """A request whose body stops coming is answered 408 once BODY_TIMEOUT_S passes (set short
    here), in the API's shape; the server goes on serving."""
    from ktransformers.server import app as A
    monkeypatch.setattr(A, "BODY_TIMEOUT_S", 0.5)
    fast = A.create_app(srv.scheduler, "demo", max_body_bytes=1 << 20)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(fast, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            c.settimeout(20)
            reply = b""
            while b"}" not in reply.partition(b"\r\n\r\n")[2]:  # (the body may come in a segment of its own)
                chunk = c.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply, reply[:300]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_slow_headers_are_cut_off(srv, monkeypatch):
    """A connection that sends its request line and headers a little at a time is closed once
    HEADER_TIMEOUT_S (short here) passes, on a fresh connection and on a kept-alive one after a
    reply; a prompt client is answered meanwhile."""
    from ktransformers.server import __main__ as M
    monkeypatch.setattr(M, "HEADER_TIMEOUT_S", 0.5)
    port = free_port()
    server = uvicorn.Server(M.uvicorn_config(srv.app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def trickle(c) -> bytes:
        """Headers a byte every 0.1 s (each resets no timer) until the server hangs up."""
        c.settimeout(10)
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
                c.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            return b""
        return c.recv(100)
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            began = time.monotonic()
            assert trickle(c) == b"" and time.monotonic() - began < 5
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            c.settimeout(10)
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            assert trickle(c) == b""
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_health_answers_while_a_huge_prompt_is_tokenized(srv):
    """An 8 MB prompt (under --max_request_mb) is tokenized off the event loop and then refused as
    longer than the context (400); /health answers meanwhile, before that refusal comes."""
    text = "the standard library " * ((8 << 20) // 21)
    done = {}

    def big():
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=300)
        done["at"], done["reply"] = time.monotonic(), r
    thread = threading.Thread(target=big)
    thread.start()
    answered = []
    while thread.is_alive():
        if httpx.get(srv.url + "/health", timeout=60).status_code == 200 and thread.is_alive():
            answered.append(time.monotonic())
        time.sleep(0.02)
    thread.join()
    assert done["reply"].status_code == 400 and "context" in done["reply"].json()["error"]["message"]
    # /health answered again and again while the prompt was in the works (with the event loop
    # blocked by it, one answer at most could slip in before the refusal)
    assert sum(t < done["at"] for t in answered) >= 3
