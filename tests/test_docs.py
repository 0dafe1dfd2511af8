"""Every fenced code block of README.md and docs/*.md runs here, so a stale snippet fails CI.

By fence language:
  python  run as a script in a subprocess (cwd: a temporary folder);
  bash    each command run in `bash` (cwd: the same folder, one line of text on stdin, as a user
          would type it); `pip install ...` and `python -m pytest ...` are not run (installing
          is not this test's business, and the suite is the one running this test);
  yaml    parsed; a list of rules is validated by the rule loader;
  text    output (tables, logs, transcripts): not run.
Any other language, or a fence without one, fails.

A mark on the line before a fence changes that:
  <!-- not run: REASON -->  skipped with REASON (a CUDA GPU, a huge model, the network);
  <!-- server -->           bash: each command starts a server, which must answer /health,
                            then is stopped; python: runs while the demo model's server listens.

The docs name a small fixed set of placeholder paths (SUBSTITUTIONS); before running, each becomes
a tiny model built once here, or the bundled demo model. Commands that would run long are
shrunk only by SHRINK: flags appended to a module's command line (argparse keeps the last),
never by changing what the doc says.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*(not run:\s*(?P<reason>.+?)|(?P<server>server))\s*-->$")
LANGUAGES = {"python", "bash", "yaml", "text"}
TYPED = "The Python interpreter\n"  # stdin of every bash command: what a user would type at the chat prompt
TIMEOUT = 600

# module run with `python -m` -> flags appended to keep it to seconds on 2 cores
SHRINK = {
    "ktransformers.local_chat": "--max_new_tokens 8 --cpu_infer 2",
    "ktransformers.bench.synth": "--layers 1 --experts 8 --vocab 1000",
    "ktransformers.bench.moe": "--shapes tiny --tokens 1 4 --copies 1 --iters 2 --rounds 1 --stream-gib 0.05 "
                               "--threads 2 --no-peer",
    "ktransformers.bench.decode": "--prompt 16 --decode 4 --repeats 1 --stream-gib 0.05 --threads 2 --no-peer",
    "ktransformers.bench.serve": "--concurrency 1 2 --requests 1 --max_tokens 4 --cache_lens 512 --cpu_infer 2",
    "ktransformers.server": "--cpu_infer 2 --port {port}",
    "ktransformers.calibrate": "--cpu_infer 2",
    "ktransformers.sft": "--cpu_infer 2",
    "ktransformers.bench.sft": "--steps 1 --warmup 0 --seq 16 24 --threads 2",
}


@dataclass
class Block:
    doc: Path
    line: int       # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None
    server: bool

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks_of(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{doc.name}:{i + 1}: a fence that never closes"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        found.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           mark.group("reason") if mark else None, bool(mark and mark.group("server"))))
        i = end + 1
    return found


ALL = [b for doc in DOCS for b in blocks_of(doc)]


# ---------------------------------------------------------------------------------------------
# the placeholders and what they become

@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """Placeholder path -> a real path: a tiny Qwen3-MoE GGUF (tokenizer in its metadata) and the
    bundled DeepSeek-V3-architecture demo model (its GGUF in a folder of its own, its HF files)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import tiny_model, train_tokenizer

    from ktransformers.demo import DEMO_GGUF, DEMO_HF_DIR
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import tokenizer_metadata, write_gguf

    root = tmp_path_factory.mktemp("doc-models")
    qwen3 = root / "qwen3-tiny.gguf"
    model = tiny_model("qwen3_moe", layers=2)
    tokenizer = train_tokenizer(320)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    write_gguf(qwen3, model.config, model.state_dict(), types=GGMLType.Q8_0,
               extra_metadata=tokenizer_metadata(tokenizer))
    deepseek_dir = root / "deepseek-gguf"
    deepseek_dir.mkdir()
    (deepseek_dir / Path(DEMO_GGUF).name).symlink_to(DEMO_GGUF)
    return {"/models/Qwen3-30B-A3B-Q4_K_M.gguf": str(qwen3),
            "/models/DeepSeek-V3-Q4_K_M/": f"{deepseek_dir}/",
            "/models/DeepSeek-V3": str(DEMO_HF_DIR)}


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory) -> dict[Path, Path]:
    """One folder per doc: its blocks run in order there, so a file one block writes (a synthetic
    GGUF under /tmp/) is there for the next."""
    return {doc: tmp_path_factory.mktemp(doc.stem) for doc in DOCS}


def substitute(code: str, models: dict[str, str], work: Path, port: int) -> str:
    code = re.sub(r"(?<![\w./-])/tmp/", f"{work}/", code)  # first: the real models lie under /tmp too
    for placeholder, real in models.items():  # longest first: /models/DeepSeek-V3-Q4_K_M/ before /models/DeepSeek-V3
        code = code.replace(placeholder, real)
    code = re.sub(r"(?<![\w./-])(ktransformers|scripts)/", f"{REPO}/\\1/", code)
    return code.replace("127.0.0.1:10002", f"127.0.0.1:{port}")


def commands(code: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments dropped, `&&`
    chains split so that their install steps can be left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        out += [part.strip() for part in line.split(" && ")
                if not re.match(r"(pip|python -m pip) install |python -m pytest\b", part.strip())]
    return out


def shrink(command: str, port: int) -> str:
    """Append the module's SHRINK flags to the pipeline stage that runs it (always the last)."""
    m = re.search(r"python -m ([\w.]+)", command)
    if not m or m.group(1) not in SHRINK:
        return command
    assert "|" not in command[m.end():], f"{command!r}: the module must be the last stage of a pipe"
    return f"{command} {SHRINK[m.group(1)].format(port=port)}".rstrip()


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", KEY="doc-test-key")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# servers

def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    url = f"http://127.0.0.1:{port}/health"
    headers = {"Authorization": "Bearer doc-test-key"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
                assert json.load(r)["status"] == "ok"
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no answer from {url} in {timeout}s")


def start(command: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------
# the test

def run_bash(block: Block, code: str, work: Path, port: int) -> None:
    cmds = commands(code)
    assert cmds or "pip install" in code, f"{block.id}: a bash block with no command"
    for cmd in cmds:
        cmd = shrink(cmd, port)
        if block.server:
            proc = start(cmd, work)
            try:
                wait_healthy(proc, port)
            finally:
                stop(proc)
            continue
        out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=work, env=env(), input=TYPED,
                             capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, f"{block.id}: `{cmd}` exited {out.returncode}:\n{out.stdout[-2000:]}\n" \
                                    f"{out.stderr[-3000:]}"


def run_python(block: Block, code: str, work: Path, port: int) -> None:
    script = work / f"block_{block.line}.py"
    script.write_text(code)
    server = start(f"{sys.executable} -m ktransformers.server {SHRINK['ktransformers.server'].format(port=port)}",
                   work) if block.server else None
    try:
        if server:
            wait_healthy(server, port)
        out = subprocess.run([sys.executable, str(script)], cwd=work, env=env(), capture_output=True, text=True,
                             timeout=TIMEOUT)
    finally:
        if server:
            stop(server)
    assert out.returncode == 0, f"{block.id}: exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def check_yaml(block: Block, code: str) -> None:
    from ktransformers.optimize.rules import parse_rules
    data = yaml.safe_load(code)
    if isinstance(data, list) and all(isinstance(r, dict) and "match" in r for r in data):
        assert parse_rules(code, block.id)


def test_every_block_has_a_known_language():
    bad = [f"{b.id}: {b.language or '(none)'}" for b in ALL if b.language not in LANGUAGES]
    assert not bad, f"fences need one of {sorted(LANGUAGES)}: {bad}"


def test_marks_are_known():
    """A comment that looks like a mark but is not one would silently run (or skip) a block."""
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.strip().startswith("<!--") and ("run" in line or "server" in line):
                assert MARK.match(line.strip()), f"{doc.name}:{n}: unknown mark {line.strip()!r}"


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block(block: Block, models, workdirs):
    if block.skip:
        pytest.skip(block.skip)
    if block.language == "text":
        return  # output, shown not run
    assert block.language in LANGUAGES, f"{block.id}: unknown fence language {block.language!r}"
    port = free_port()
    code = substitute(block.code, models, workdirs[block.doc], port)
    if block.language == "yaml":
        check_yaml(block, code)
    elif block.language == "python":
        run_python(block, code, workdirs[block.doc], port)
    else:
        run_bash(block, code, workdirs[block.doc], port)
