"""Chat with a model from the terminal: `python -m ktransformers.local_chat`.

    python -m ktransformers.local_chat --gguf_path DIR_OR_FILE [--model_path HF_DIR]
        [--optimize_config_path RULES.yaml] [--cpu_infer N] [--max_new_tokens N] [--prompt TEXT]

With no model flags it chats with the bundled demo model. On a terminal it is a conversation
with line editing and history (readline; kept in ~/.ktransformers_history) and the commands
/bye, /exit, /clear and /help (a line starting with \"\"\" opens a multi-line message, closed by
a line ending with \"\"\"). With `--prompt`, `--prompt_file` or a pipe on stdin it answers once
and exits. Each answer is followed by upstream's timing lines (prompt eval / eval count,
duration, rate).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HISTORY_FILE = ".ktransformers_history"  # under the user's home
HISTORY_LENGTH = 1000
EXIT_HINT = "Type /bye or press Ctrl-D to leave, /help for commands."
COMMANDS = {  # name -> what it does; the names are matched case-insensitively, alone on their line
    "/bye": "leave the chat; so do exit or quit alone on a line, Ctrl-D, and Ctrl-C at the prompt",
    "/exit": "the same as /bye",
    "/clear": "forget the conversation and start a new one",
    "/help": "show this list",
}
HELP = "\n".join([f"  {name:<8}{text}" for name, text in COMMANDS.items()] + [
    '  """     a line starting with """ opens a multi-line message; a line ending with """ closes it',
    "  Ctrl-C  during an answer stops it and returns to the prompt"])


# -- flags ------------------------------------------------------------------------------------
class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flags with their defaults; the epilog's list of chat commands as it is written."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (`error: ...`), as the chat's other errors are."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: a bad value exits with a one-line error naming the flag."""
    p = _Parser(prog="python -m ktransformers.local_chat", description=__doc__.split("\n")[0],
                formatter_class=_Formatter, epilog="chat commands (on a terminal):\n" + HELP)
    p.add_argument("--model_path", help="HF model directory (config + tokenizer), or a repo id in the local Hugging Face "
                                        "cache; optional when the GGUF has both")
    p.add_argument("--gguf_path", help="GGUF file or directory (split files found beside it); default: the demo model")
    p.add_argument("--optimize_config_path", help="rule file (YAML); default: the shipped one for the architecture")
    p.add_argument("--lora_path", help="a LoRA adapter (peft's directory, as python -m ktransformers.sft saves it), "
                                       "merged into the weights it adapts at load")
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--cpu_infer", type=int, default=None, help="threads of the CPU kernels (default: all cores)")
    p.add_argument("--use_cuda_graph", type=_bool, default=True, help="capture decode in CUDA graphs (GPU only)")
    p.add_argument("--prefill_gpu_threshold", type=int, default=None,
                   help="prefill chunks of at least this many tokens stream the experts to the GPU "
                        "(default: the rule file's prefill_gpu_threshold; 0 turns it off)")
    p.add_argument("--prompt_file", help="answer the text of this file once, then exit")
    p.add_argument("--prompt", help="answer this text once, then exit")
    p.add_argument("--mode", choices=("normal", "long_context"), default="normal",
                   help="long_context: MLA attends in latent space during prefill too (less memory)")
    p.add_argument("--force_think", type=_bool, nargs="?", const=True, default=False,
                   help="start the answer with <think> (reasoning models); also --force_think true/false")
    p.add_argument("--reasoning_effort", choices=("low", "medium", "high"), default="medium",
                   help="gpt-oss (the harmony format): how much it reasons before answering")
    p.add_argument("--chunk_size", type=int, default=8192, help="prompt tokens per prefill forward")
    p.add_argument("--cache_lens", type=int, default=8192, help="token slots of the KV cache")
    p.add_argument("--device", default=None, help="device of the non-expert parts: cpu, cuda or cuda:N "
                                                  "(default: cuda if present, else cpu)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--repetition_penalty", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    from .upstream import CHAT_FLAGS, drop_upstream_flags
    args = p.parse_args(drop_upstream_flags(list(sys.argv[1:] if argv is None else argv), CHAT_FLAGS))
    problem = check_args(args)
    if problem is not None:
        p.error(problem)
    return args


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# (flag, the test its value must pass when given, what the test asks)
_VALUE_RULES = (
    ("max_new_tokens", lambda v: v > 0, "must be positive"),
    ("cpu_infer", lambda v: v > 0, "must be positive"),
    ("chunk_size", lambda v: v > 0, "must be positive"),
    ("cache_lens", lambda v: v > 0, "must be positive"),
    ("prefill_gpu_threshold", lambda v: v >= 0, "must be >= 0 (0 turns it off)"),
    ("temperature", lambda v: v >= 0, "must be >= 0 (0 is greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 turns it off)"),
    ("repetition_penalty", lambda v: v > 0, "must be > 0 (1 turns it off)"),
)


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags' values (naming the flag), or None; reads --prompt_file into
    args.prompt so that an unreadable file fails before the model loads."""
    for name, ok, need in _VALUE_RULES:
        value = getattr(args, name)
        if value is not None and not ok(value):
            return f"--{name} {need}, got {value}"
    return _check_paths(args) or _check_device(args.device) or _check_prompt(args)


def _check_paths(args: argparse.Namespace) -> str | None:
    if args.model_path is not None:
        from .loader import resolve_model_path
        try:
            args.model_path = str(resolve_model_path(args.model_path))
        except FileNotFoundError as e:
            return str(e)
        if not Path(args.model_path).is_dir():
            return f"--model_path {args.model_path!r} is not a directory"
    if args.model_path is not None and args.gguf_path is None:
        return "--gguf_path is required with --model_path (the weights live in GGUF or safetensors files)"
    if args.gguf_path is not None and not Path(args.gguf_path).exists():
        return f"--gguf_path {args.gguf_path!r} does not exist"
    if args.optimize_config_path is not None and not Path(args.optimize_config_path).is_file():
        return f"--optimize_config_path {args.optimize_config_path!r} is not a file"
    return None


def _check_device(device: str | None) -> str | None:
    if device is None or device == "cpu":
        return None
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"--device {device}: no CUDA device is available (use --device cpu)"
    if m.group(1) is not None and int(m.group(1)) >= count:
        return f"--device {device}: there are {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def _check_prompt(args: argparse.Namespace) -> str | None:
    if args.prompt is not None and args.prompt_file is not None:
        return "--prompt and --prompt_file: give one of them"
    if any(not s for s in args.stop):
        return "--stop: a stop string must not be empty"
    if args.prompt_file is not None:
        try:
            args.prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            return f"--prompt_file {args.prompt_file!r} is not UTF-8 text"
        except OSError as e:
            return f"--prompt_file {args.prompt_file!r} cannot be read: {e.strerror or e}"
        if not args.prompt.strip():
            return f"--prompt_file {args.prompt_file!r} is empty"
    elif args.prompt is not None and not args.prompt.strip():
        return "--prompt is empty"
    return None


# -- loading ----------------------------------------------------------------------------------
def model_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    """(gguf_path, model_path): the flags', or the bundled demo model's when neither is given."""
    if args.gguf_path is not None:
        return args.gguf_path, args.model_path
    from .demo import DEMO_GGUF, DEMO_HF_DIR
    print(f"no --gguf_path: chatting with the bundled demo model ({Path(DEMO_GGUF).name}, a 13M-parameter "
          f"DeepSeek-V3-architecture MoE that continues English text)", file=sys.stderr)
    return str(DEMO_GGUF), str(DEMO_HF_DIR)


def load_engine(args: argparse.Namespace):
    """The model loaded as the flags say, in an Engine."""
    from .engine.generate import Engine
    from .loader import freeze_heap, load_model

    gguf_path, model_path = model_paths(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model(gguf_path, model_path, args.optimize_config_path, default_device=device,
                        cpu_infer=args.cpu_infer, cache_lens=args.cache_lens, lora_path=args.lora_path)
    freeze_heap()
    if args.prefill_gpu_threshold is not None:
        from .operators.experts import set_prefill_gpu_threshold
        set_prefill_gpu_threshold(loaded.model, args.prefill_gpu_threshold)
    if args.mode == "long_context":
        _absorb_prefill(loaded.model)
    engine = Engine(loaded.model, loaded.tokenizer, cache_lens=args.cache_lens, chunk_size=args.chunk_size,
                    use_cuda_graph=args.use_cuda_graph)
    engine.warm_up(batch_sizes=(1,))
    return engine


def sampling_params(model: torch.nn.Module, args: argparse.Namespace):
    """The model's generation_config, overridden by the sampling flags that are given."""
    from .engine.sampling import SamplingParams
    gen_config = getattr(model, "generation_config", None)
    # a model that says nothing about sampling gets a usual chat default, not temperature 1
    overrides = {} if getattr(gen_config, "temperature", None) is not None else {"temperature": 0.7, "top_p": 0.9}
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "repetition_penalty": args.repetition_penalty, "seed": args.seed}
    overrides |= {k: v for k, v in flags.items() if v is not None}
    if args.greedy:
        overrides["do_sample"] = False
    return SamplingParams.from_generation_config(gen_config, **overrides)


def _absorb_prefill(model: torch.nn.Module) -> None:
    import dataclasses

    from .operators.attention import KDeepseekV2Attention
    for m in model.modules():
        if isinstance(m, KDeepseekV2Attention):
            m.options = dataclasses.replace(m.options, absorb_for_prefill=True)


# -- the conversation -------------------------------------------------------------------------
def render(tokenizer, messages: list[dict], force_think: bool) -> list[int]:
    """The chat template applied to `messages`, ready for the assistant's turn (without a
    template: the messages' texts, one per line)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text + ("<think>\n" if force_think else ""), add_special_tokens=False)["input_ids"]
    text = "\n".join(m["content"] for m in messages)
    return tokenizer(text + ("<think>\n" if force_think else ""))["input_ids"]


def prompt_ids(tokenizer, message: str, force_think: bool) -> list[int]:
    """The chat template applied to one user message (plain text without a template)."""
    return render(tokenizer, [{"role": "user", "content": message}], force_think)


class Conversation:
    """The turns so far, and the cache sequence holding them: each answer's prompt is the whole
    conversation, whose prefix already in the cache is not computed again. Models of the harmony
    format (gpt-oss) take their prompts from openai-harmony and show their reasoning (the
    analysis channel) apart from the answer (the final channel), which alone joins the turns."""

    def __init__(self, engine, args: argparse.Namespace, params):
        from .engine.harmony import harmony_chat
        self.engine, self.args, self.params = engine, args, params
        self.harmony = harmony_chat(engine.tokenizer, getattr(args, "reasoning_effort", "medium"))
        self.messages: list[dict] = []
        self.seq = engine.new_sequence()

    def ask(self, message: str, out=sys.stdout) -> None:
        """Stream the answer to `message` to `out`, then the timing lines; the exchange joins the
        conversation once the answer is complete (an interrupted one is forgotten)."""
        turn = self.messages + [{"role": "user", "content": message}]
        if self.harmony is not None:
            generation = self.engine.generate(self.harmony.render(turn), self.params, self.args.max_new_tokens,
                                              seq=self.seq, stop_ids=self.harmony.stop_ids)
            text = stream_harmony(generation, self.harmony, out)
        else:
            ids = render(self.engine.tokenizer, turn, self.args.force_think)
            generation = self.engine.generate(ids, self.params, self.args.max_new_tokens, stop=self.args.stop,
                                              seq=self.seq)
            text = _stream(generation, out, self.args.force_think)
        self.messages = turn + [{"role": "assistant", "content": text}]
        _finish(generation, self.engine, out, in_chat=True)

    def clear(self) -> None:
        """Forget the turns and their cached entries."""
        self.engine.release(self.seq)
        self.seq = self.engine.new_sequence()
        self.messages = []


def answer(engine, tokenizer, message: str, args, params, out=sys.stdout) -> None:
    """Stream one answer to `out` (no conversation), then the timing lines."""
    from .engine.harmony import harmony_chat
    harmony = harmony_chat(tokenizer, getattr(args, "reasoning_effort", "medium"))
    if harmony is not None:
        generation = engine.generate(harmony.render([{"role": "user", "content": message}]), params,
                                     args.max_new_tokens, stop_ids=harmony.stop_ids)
        stream_harmony(generation, harmony, out)
    else:
        generation = engine.generate(prompt_ids(tokenizer, message, args.force_think), params, args.max_new_tokens,
                                     stop=args.stop)
        _stream(generation, out, args.force_think)
    _finish(generation, engine, out, in_chat=False)


REASONING, ANSWER = "Thinking: ", "Answer: "


def stream_harmony(generation, harmony, out) -> str:
    """Write a harmony answer as it comes: the reasoning (analysis channel) after "Thinking: ",
    then the answer (final channel) after "Answer: " on a line of its own; other channels (tool
    calls) after their name. Returns the final channel's text."""
    channel, final = None, []
    for piece in harmony.parse(generation.token_ids()):
        if piece.channel != channel:
            label = {"analysis": REASONING, "final": ANSWER}.get(piece.channel, f"[{piece.channel}] ")
            out.write(("\n\n" if channel is not None else "") + label)
            channel = piece.channel
        if piece.channel == "final":
            final.append(piece.text)
        out.write(piece.text)
        out.flush()
    out.write("\n")
    return "".join(final)


def _stream(generation, out, force_think: bool) -> str:
    """Write the answer's pieces as they come; its whole text."""
    pieces = ["<think>\n"] if force_think else []
    out.write("".join(pieces))
    for piece in generation:
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def _finish(generation, engine, out, in_chat: bool) -> None:
    if generation.finish_reason == "cache_full":
        again = "; /clear starts a new conversation" if in_chat else ""
        out.write(f"[stopped: the KV cache is full ({engine.cache.capacity} tokens); raise --cache_lens{again}]\n")
    out.write("\n".join(generation.stats.lines()) + "\n")
    out.flush()


# -- the terminal -----------------------------------------------------------------------------
def read_message(prompt: str = "Chat: ", read: Callable[[str], str] = input) -> str | None:
    """One message from the terminal; None at end of input. \"\"\" opens a multi-line message."""
    try:
        line = read(prompt)
    except EOFError:
        return None
    if not line.lstrip().startswith('"""'):
        return line
    lines = [line.lstrip()[3:]]
    while not lines[-1].rstrip().endswith('"""'):
        try:
            lines.append(read(""))
        except EOFError:
            break
    text = "\n".join(lines).rstrip()
    return text.removesuffix('"""')


def command(message: str) -> str | None:
    """The command `message` is (its name, lower case), or None for text for the model. A
    command is alone on its line; /exit, and a lone `exit` or `quit`, are /bye."""
    word = message.strip().lower()
    if word in ("/exit", "exit", "quit"):
        return "/bye"
    return word if word in COMMANDS else None


def looks_like_command(message: str) -> bool:
    """A lone /word that is no command: a typo far more often than a message for the model
    (a line starting with a space goes to the model as it is)."""
    return not message.startswith(" ") and re.fullmatch(r"/[A-Za-z]+", message.strip()) is not None


def chat_loop(conversation, read: Callable[[], str | None] = read_message, out=sys.stdout) -> int:
    """Read messages and answer them until /bye, end of input or Ctrl-C at the prompt. Commands
    never reach the model; Ctrl-C during an answer stops only that answer."""
    from .cache import CacheFullError
    while True:
        try:
            message = read()
        except KeyboardInterrupt:  # at the prompt: leave, on a fresh line
            message = None
        if message is None:
            out.write("\n")
            return 0
        if command(message) == "/bye":
            return 0
        if command(message) is not None or looks_like_command(message):
            _run_command(conversation, message, out)
        elif message.strip():
            try:
                conversation.ask(message, out)
            except KeyboardInterrupt:
                out.write("\n[interrupted]\n")
            except CacheFullError as e:  # the conversation outgrew the cache; the chat goes on
                out.write(f"error: {e}; /clear starts a new conversation\n")
        out.flush()


def _run_command(conversation, message: str, out) -> None:
    name = command(message)
    if name == "/clear":
        conversation.clear()
        out.write("[the conversation is forgotten]\n")
    elif name == "/help":
        out.write(HELP + "\n")
    else:
        out.write(f"unknown command {message.strip()}; /help lists the commands "
                  f"(start the line with a space to send it to the model)\n")
    out.flush()


def line_editing() -> Callable[[], None]:
    """Line editing and history for input() where readline exists, the history loaded from the
    user's home; returns what saves it. Neither ever fails the chat: a history that cannot be
    read or written is just not kept."""
    try:
        import readline
        path = Path.home() / HISTORY_FILE
    except (ImportError, RuntimeError):  # no readline (Windows), or no home directory
        return lambda: None
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LENGTH)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def interactive(engine, args: argparse.Namespace, params) -> int:
    """The chat on a terminal, with line editing and history."""
    save_history = line_editing()
    print(EXIT_HINT, flush=True)
    try:
        return chat_loop(Conversation(engine, args, params))
    finally:
        save_history()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .cache import CacheFullError

    try:
        once = args.prompt
        if once is None and not sys.stdin.isatty():
            once = sys.stdin.read()
            if not once.strip():
                raise ValueError("the input on stdin is empty")
        engine = load_engine(args)
        params = sampling_params(engine.model, args)
        if once is not None:
            answer(engine, engine.tokenizer, once, args, params)
            return 0
        return interactive(engine, args, params)
    except KeyboardInterrupt:  # while loading or answering once
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, CacheFullError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
