"""`python -m ktransformers.local_chat` as users run it: through a pipe, through a terminal
(pseudo-terminal, multi-line input), and the one-line errors for wrong inputs."""
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from tiny import tiny_model, train_tokenizer

from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import tokenizer_metadata, write_gguf

CHAT = [sys.executable, "-m", "ktransformers.local_chat"]
STATS = ("prompt eval count:", "prompt eval duration:", "prompt eval rate:", "eval count:", "eval duration:",
         "eval rate:")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "qwen3.gguf"
    model = tiny_model("qwen3_moe", layers=2)
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0,
               extra_metadata=tokenizer_metadata(train_tokenizer(320)))
    return path


def run(args, stdin="", timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(CHAT + args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_pipe_answers_once_with_stats(gguf):
    out = run(["--gguf_path", str(gguf), "--max_new_tokens", "6", "--greedy", "--cpu_infer", "1"],
              stdin="the quick brown fox")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] + ":" for line in lines[-6:]] == list(STATS)
    assert "eval count: 6 token(s)" in lines
    answer = "\n".join(lines[:-6])
    again = run(["--gguf_path", str(gguf), "--max_new_tokens", "6", "--greedy", "--prompt", "the quick brown fox"])
    assert again.returncode == 0 and "\n".join(again.stdout.splitlines()[:-6]) == answer  # greedy: same text


def test_terminal_session_with_multiline_input(gguf):
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(CHAT + ["--gguf_path", str(gguf), "--max_new_tokens", "4", "--greedy"], stdin=slave,
                            stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, count: int, timeout: float = 120) -> None:
        nonlocal seen
        end = time.time() + timeout
        while seen.count(marker) < count:
            assert time.time() < end, f"no {marker!r} after {timeout}s; output: {seen[-2000:]!r}"
            if select.select([master], [], [], 1)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
    try:
        read_until(b"Chat: ", 1)
        os.write(master, b"hello world\n")
        read_until(b"eval rate:", 2)  # "prompt eval rate" and "eval rate"
        read_until(b"Chat: ", 2)
        os.write(master, b'"""the lazy\n')
        os.write(master, b'dog"""\n')
        read_until(b"eval rate:", 4)
        read_until(b"Chat: ", 3)
        assert seen.count(b"prompt eval count:") == 2
        os.write(master, b"\x04")  # end of input: the chat ends cleanly
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(master)


@pytest.mark.parametrize("args, message", [
    (["--gguf_path", "/nonexistent/model.gguf"], "does not exist"),
    (["--model_path", "/nonexistent/dir", "--gguf_path", "/nonexistent/m.gguf"], "--model_path"),
])
def test_wrong_paths_are_one_line_errors(args, message):
    out = run(args + ["--prompt", "hi"], timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: ")


def test_gguf_of_another_architecture(gguf, tmp_path):
    deepseek = tiny_model("deepseek_v3", layers=2)
    deepseek.config.save_pretrained(tmp_path)
    out = run(["--model_path", str(tmp_path), "--gguf_path", str(gguf), "--prompt", "hi"], timeout=60)
    assert out.returncode == 2 and "qwen3moe" in out.stderr and "deepseek_v3" in out.stderr
    assert out.stderr.count("\n") == 1


def test_rule_file_without_experts(gguf, tmp_path):
    rules = tmp_path / "no-experts.yaml"
    rules.write_text('- match:\n    name: "^model\\\\.layers\\\\..*\\\\.self_attn$"\n'
                     "  replace:\n    class: KGQAAttention\n")
    out = run(["--gguf_path", str(gguf), "--optimize_config_path", str(rules), "--prompt", "hi"], timeout=60)
    assert out.returncode == 2 and "mlp.experts" in out.stderr and "KTransformersExperts" in out.stderr
    assert out.stderr.count("\n") == 1


def test_demo_model_answers_with_no_model_flags():
    """The README's first command: no flags at all, the bundled demo model continues English."""
    out = run(["--prompt", "The function returns", "--max_new_tokens", "24", "--greedy"])
    assert out.returncode == 0, out.stderr
    assert "demo model" in out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] + ":" for line in lines[-6:]] == list(STATS)
    text = "\n".join(lines[:-6])
    words = text.split()
    letters = sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)
    common = {"the", "a", "is", "of", "to", "and", "in", "that", "an", "object", "function", "returns", "value"}
    assert len(words) >= 8 and letters > 0.8 and sum(w.lower().strip(".,") in common for w in words) >= 2, text
