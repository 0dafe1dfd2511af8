"""`python -m ktransformers.local_chat` as users run it: through a pipe, through a terminal
(pseudo-terminal, multi-line input, commands, history), the chat loop driven by scripted input,
the timing lines as upstream prints them, and the one-line errors for wrong inputs."""
import fcntl
import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest
from tiny import tiny_model, train_tokenizer

from ktransformers import local_chat
from ktransformers.engine.generate import GenerationStats
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import tokenizer_metadata, write_gguf

CHAT = [sys.executable, "-m", "ktransformers.local_chat"]
STATS = ("prompt eval count:", "prompt eval duration:", "prompt eval rate:", "eval count:", "eval duration:",
         "eval rate:")
# upstream's lines: the values start in one column, durations and rates to two decimals
STATS_RE = [r"prompt eval count:    \d+ token\(s\)", r"prompt eval duration: \d+\.\d\ds",
            r"prompt eval rate:     \d+\.\d\d tokens/s", r"eval count:           \d+ token\(s\)",
            r"eval duration:        \d+\.\d\ds", r"eval rate:            \d+\.\d\d tokens/s"]


def assert_stats(lines: list[str]) -> None:
    assert len(lines) == 6 and all(re.fullmatch(p, line) for p, line in zip(STATS_RE, lines)), lines


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "qwen3.gguf"
    model = tiny_model("qwen3_moe", layers=2)
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0,
               extra_metadata=tokenizer_metadata(train_tokenizer(320)))
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A home of the tests' own: the chat's history file goes there, not into the user's."""
    return tmp_path_factory.mktemp("home")


def run(args, stdin="", timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(CHAT + args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_pipe_answers_once_with_stats(gguf):
    out = run(["--gguf_path", str(gguf), "--max_new_tokens", "6", "--greedy", "--cpu_infer", "1"],
              stdin="the quick brown fox")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] + ":" for line in lines[-6:]] == list(STATS)
    assert_stats(lines[-6:])
    assert "eval count:           6 token(s)" in lines
    answer = "\n".join(lines[:-6])
    again = run(["--gguf_path", str(gguf), "--max_new_tokens", "6", "--greedy", "--prompt", "the quick brown fox"])
    assert again.returncode == 0 and "\n".join(again.stdout.splitlines()[:-6]) == answer  # greedy: same text


def _controlling_terminal() -> None:
    """In the chat's process before it starts: the pty becomes its controlling terminal, and
    SIGINT is delivered and default there, as in a user's shell. (A child inherits its parent's
    blocked signals and an ignored SIGINT; something earlier in a test session can leave either.)"""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """The chat on a pseudo-terminal, as a user at a keyboard runs it."""

    def __init__(self, args: list[str], home):
        self.master, slave = pty.openpty()
        env = dict(os.environ, PYTHONUNBUFFERED="1", HOME=str(home), TERM="xterm")
        # the terminal is the chat's controlling one, so that Ctrl-C is a SIGINT there as it is for users
        self.proc = subprocess.Popen(CHAT + args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True,
                                     preexec_fn=_controlling_terminal)
        os.close(slave)
        self.seen = b""

    def read_until(self, marker: bytes, count: int = 1, timeout: float = 120) -> None:
        """Read until `marker` has been seen `count` times (or the chat has closed the terminal)."""
        self._read_while(lambda: self.seen.count(marker) < count, f"{marker!r} x{count}", timeout)

    def read_more(self, n: int, timeout: float = 120) -> None:
        """Read until `n` more bytes have come."""
        want = len(self.seen) + n
        self._read_while(lambda: len(self.seen) < want, f"{n} more bytes", timeout)

    def _read_while(self, waiting, what: str, timeout: float) -> None:
        end = time.time() + timeout
        while waiting():
            assert time.time() < end, f"no {what} after {timeout}s; output: {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], 1)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:
                    break

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exited_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def exit_code(self) -> int:
        """The exit code once the chat has ended by itself, with the rest of its output read."""
        code = self.proc.wait(timeout=30)
        while select.select([self.master], [], [], 0.5)[0]:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the terminal's other side is closed: all was read
                break
            if not chunk:
                break
            self.seen += chunk
        return code

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def test_terminal_session_with_multiline_input(gguf, home):
    term = Terminal(["--gguf_path", str(gguf), "--max_new_tokens", "4", "--greedy"], home)
    try:
        term.read_until(b"Chat: ", 1)
        term.type(b"hello world\n")
        term.read_until(b"eval rate:", 2)  # "prompt eval rate" and "eval rate"
        term.read_until(b"Chat: ", 2)
        term.type(b'"""the lazy\n')
        term.type(b'dog"""\n')
        term.read_until(b"eval rate:", 4)
        term.read_until(b"Chat: ", 3)
        assert term.seen.count(b"prompt eval count:") == 2
        term.type(b"\x04")  # end of input: the chat ends cleanly
        assert term.exit_code() == 0
    finally:
        term.close()


def test_terminal_commands_and_history(gguf, home):
    """The exit hint, /help, /clear and /bye on a terminal, none answered by the model; the history
    kept in the home directory comes back in the next session (up arrow); Ctrl-C during an answer
    returns to the prompt, and at the prompt leaves without a traceback."""
    history = home / local_chat.HISTORY_FILE
    history.unlink(missing_ok=True)
    term = Terminal(["--gguf_path", str(gguf), "--max_new_tokens", "3", "--greedy"], home)
    try:
        term.read_until(b"Chat: ")
        assert local_chat.EXIT_HINT.encode() in term.seen
        term.type(b"/help\n")
        term.read_until(b"Chat: ", 2)
        assert all(name.encode() in term.seen for name in local_chat.COMMANDS)
        term.type(b"/clear\n")
        term.read_until(b"Chat: ", 3)
        term.type(b"/bye\n")
        assert term.exit_code() == 0
        assert b"eval rate:" not in term.seen  # no command reached the model
    finally:
        term.close()
    assert history.read_text().split()[-3:] == ["/help", "/clear", "/bye"]

    # the demo model, greedy, goes on for far more than the few tokens seen before the Ctrl-C
    term = Terminal(["--max_new_tokens", "5000", "--greedy"], home)
    try:
        term.read_until(b"Chat: ")
        term.type(b"\x1b[A\x1b[A\x1b[A\n")  # up three times: "/help" of the session before
        term.read_until(local_chat.COMMANDS["/clear"].encode())
        term.read_until(b"Chat: ", 2)
        term.type(b"The function returns\n")
        term.read_until(b"The function returns\r\n")
        term.read_more(20)  # some of the answer has streamed
        term.type(b"\x03")  # Ctrl-C during the answer
        term.read_until(b"[interrupted]")
        term.read_until(b"Chat: ", 3)
        term.type(b"\x03")  # Ctrl-C at the prompt
        # (on a loaded machine a key pressed the instant the prompt appears is now and then not
        # seen by readline, as a user would see it: pressing again leaves)
        for _ in range(3):
            if term.exited_within(5):
                break
            term.type(b"\x03")
        assert term.exit_code() == 0
        assert b"Traceback" not in term.seen and b"eval rate:" not in term.seen, term.seen[-2000:]
    finally:
        term.close()


@pytest.mark.parametrize("args, message", [
    (["--gguf_path", "/nonexistent/model.gguf"], "does not exist"),
    (["--model_path", "/nonexistent/dir", "--gguf_path", "/nonexistent/m.gguf"], "--model_path"),
    (["--top_p", "0"], "--top_p"),
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


def test_a_synthetic_file_chats(tmp_path):
    """bench.synth's file as it is (random weights, its own byte-level BPE and ChatML template):
    local_chat builds its tokenizer from the file and answers, with no --model_path."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "glm4_moe", "vocab_size": 1200, "hidden_size": 128, "intermediate_size": 256, '
        '"moe_intermediate_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, '
        '"n_shared_experts": 1, "partial_rotary_factor": 0.5}')
    path = tmp_path / "synth.gguf"
    subprocess.run([sys.executable, "-m", "ktransformers.bench.synth", "--config", str(tmp_path / "config.json"),
                    "--type", "Q8_0", "--out", str(path)], check=True, capture_output=True)
    out = run(["--gguf_path", str(path), "--max_new_tokens", "5", "--greedy", "--cpu_infer", "1", "--prompt", "hi"])
    assert out.returncode == 0, out.stderr
    assert "eval count:           5 token(s)" in out.stdout.splitlines()


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


# -- the timing lines -------------------------------------------------------------------------
def test_stats_lines_are_rounded_and_aligned_as_upstream():
    lines = GenerationStats(prompt_tokens=12, prompt_seconds=0.5213, eval_tokens=60, eval_seconds=2.6049).lines()
    assert lines == ["prompt eval count:    12 token(s)",
                     "prompt eval duration: 0.52s",
                     "prompt eval rate:     23.02 tokens/s",
                     "eval count:           60 token(s)",
                     "eval duration:        2.60s",
                     "eval rate:            23.03 tokens/s"]
    assert_stats(lines)
    assert_stats(GenerationStats().lines())  # nothing timed: rates 0.00, never a division by zero
    assert not re.fullmatch(STATS_RE[1], "prompt eval duration: 0.041979965999985325s")  # the old raw floats


# -- the chat loop, driven by scripted input --------------------------------------------------
class Recorder:
    """A conversation that records what reaches the model."""

    def __init__(self, interrupt: set[str] = frozenset()):
        self.asked, self.cleared, self.interrupt = [], 0, interrupt

    def ask(self, message, out):
        self.asked.append(message)
        if message in self.interrupt:
            raise KeyboardInterrupt  # Ctrl-C while the answer streams
        out.write(f"answer to {message}\n")

    def clear(self):
        self.cleared += 1


def script(*lines):
    """A read function answering `lines` in turn, then end of input; `.left` holds what was not read."""
    left = list(lines)

    def read():
        if not left:
            return None
        line = left.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line
    read.left = left
    return read


def test_commands_never_reach_the_model():
    chat, out = Recorder(), io.StringIO()
    read = script("hello", "/help", "/HELP ", "/clear", "/bye!", "/foo", " /foo", "", "/usr/bin is a path",
                  "/bye", "after bye")
    assert local_chat.chat_loop(chat, read, out) == 0
    assert chat.asked == ["hello", "/bye!", " /foo", "/usr/bin is a path"]
    assert chat.cleared == 1 and read.left == ["after bye"]
    text = out.getvalue()
    assert text.count(local_chat.HELP) == 2 and all(name in local_chat.HELP for name in local_chat.COMMANDS)
    assert "unknown command /foo; /help lists the commands" in text


@pytest.mark.parametrize("leave", ["/bye", "/exit", "/Exit", " /BYE ", "exit", "quit", None,
                                   KeyboardInterrupt()])
def test_ways_to_leave(leave):
    """/bye, /exit, a lone exit or quit, end of input (Ctrl-D) and Ctrl-C at the prompt."""
    chat = Recorder()
    read = script("hello", leave, "after")
    assert local_chat.chat_loop(chat, read, io.StringIO()) == 0
    assert chat.asked == ["hello"] and read.left == ["after"]


def test_ctrl_c_during_an_answer_returns_to_the_prompt():
    chat, out = Recorder(interrupt={"long"}), io.StringIO()
    assert local_chat.chat_loop(chat, script("long", "short"), out) == 0
    assert chat.asked == ["long", "short"]
    assert "[interrupted]" in out.getvalue() and "answer to short" in out.getvalue()


@pytest.fixture(scope="module")
def demo_engine():
    args = local_chat.parse_args(["--max_new_tokens", "3", "--greedy", "--cpu_infer", "1"])
    with pytest.MonkeyPatch.context() as mp:  # the test process goes on: its heap stays collectable
        mp.setattr("ktransformers.loader.freeze_heap", lambda: None)
        engine = local_chat.load_engine(args)
    return engine, args, local_chat.sampling_params(engine.model, args)


def test_clear_forgets_the_conversation_and_its_cached_prefix(demo_engine):
    engine, args, params = demo_engine
    generations = []
    generate = engine.generate

    def spy(*a, **kw):
        generations.append(generate(*a, **kw))
        return generations[-1]
    engine.generate = spy
    try:
        chat, out = local_chat.Conversation(engine, args, params), io.StringIO()
        first_seq = chat.seq
        read = script("the first words", "the second words", "/clear", "the third words", "/bye")
        assert local_chat.chat_loop(chat, read, out) == 0
    finally:
        del engine.generate
    prompts = [engine.tokenizer.decode(g.prompt_ids) for g in generations]
    assert len(prompts) == 3 and not any("/" in p for p in prompts)
    assert "the first words" in prompts[1] and "the second words" in prompts[1]  # one conversation
    assert "the third words" in prompts[2] and "first" not in prompts[2] and "second" not in prompts[2]
    second, third = generations[1].stats, generations[2].stats
    assert second.prompt_tokens < len(generations[1].prompt_ids)  # the first turn came from the cache
    assert third.prompt_tokens == len(generations[2].prompt_ids)  # after /clear nothing did
    assert chat.seq is not first_seq and engine.cached_tokens(first_seq) == []
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert out.getvalue().count("eval rate:") == 6  # three answers, each with its timing lines


# -- bad flag values --------------------------------------------------------------------------
def _bad_flags(tmp):
    text = tmp / "prompt.txt"
    text.write_text("hi")
    (tmp / "empty.txt").write_text("  \n")
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return [
        (["--max_new_tokens", "0"], "--max_new_tokens"), (["--max_new_tokens", "-5"], "--max_new_tokens"),
        (["--max_new_tokens", "many"], "--max_new_tokens"), (["--cpu_infer", "0"], "--cpu_infer"),
        (["--chunk_size", "0"], "--chunk_size"), (["--cache_lens", "-1"], "--cache_lens"),
        (["--cache_lens", "1.5"], "--cache_lens"), (["--prefill_gpu_threshold", "-1"], "--prefill_gpu_threshold"),
        (["--temperature", "-0.1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
        (["--top_p", "0"], "--top_p"), (["--top_p", "1.01"], "--top_p"), (["--top_k", "-1"], "--top_k"),
        (["--repetition_penalty", "0"], "--repetition_penalty"), (["--mode", "fast"], "--mode"),
        (["--device", "tpu"], "--device"), (["--device", "cuda:99"], "--device"),
        (["--use_cuda_graph", "maybe"], "--use_cuda_graph"), (["--seed", "x"], "--seed"),
        (["--gguf_path", str(tmp / "missing.gguf")], "--gguf_path"),
        (["--model_path", str(tmp / "missing")], "--model_path"),
        (["--model_path", str(tmp)], "--gguf_path"),  # a model directory without weights
        (["--optimize_config_path", str(tmp / "missing.yaml")], "--optimize_config_path"),
        (["--prompt_file", str(tmp / "missing.txt")], "--prompt_file"),
        (["--prompt_file", str(tmp)], "--prompt_file"),  # a directory
        (["--prompt_file", str(tmp / "empty.txt")], "--prompt_file"),
        (["--prompt_file", str(tmp / "latin1.txt")], "--prompt_file"),
        (["--prompt", " "], "--prompt"), (["--prompt", "hi", "--prompt_file", str(text)], "--prompt_file"),
        (["--stop", ""], "--stop"), (["--bogus_flag", "1"], "--bogus_flag"),
    ]


def test_every_bad_flag_value_is_a_one_line_error(tmp_path, capsys):
    for argv, flag in _bad_flags(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            local_chat.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2, argv
        assert err.startswith("error: ") and err.count("\n") == 1 and flag in err, (argv, err)


def test_good_flags_pass_and_prompt_file_is_read(tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("the quick brown fox\n")
    args = local_chat.parse_args(["--prompt_file", str(text), "--top_p", "1", "--temperature", "0", "--top_k", "0",
                                  "--device", "cpu", "--prefill_gpu_threshold", "0"])
    assert args.prompt == "the quick brown fox\n"
