"""Chat with a model from the terminal: `python -m ktransformers.local_chat`.

    python -m ktransformers.local_chat --gguf_path DIR_OR_FILE [--model_path HF_DIR]
        [--optimize_config_path RULES.yaml] [--cpu_infer N] [--max_new_tokens N] [--prompt TEXT]

With no model flags it chats with the bundled demo model. Interactive on a terminal (a line
starting with \"\"\" opens a multi-line message, closed by a line ending with \"\"\"); with
`--prompt`, `--prompt_file` or a pipe on stdin it answers once and exits. Each answer is
followed by upstream's timing lines (prompt eval / eval count, duration, rate).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ktransformers.local_chat", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_path", help="HF model directory (config + tokenizer); optional when the GGUF has both")
    p.add_argument("--gguf_path", help="GGUF file or directory (split files found beside it); default: the demo model")
    p.add_argument("--optimize_config_path", help="rule file (YAML); default: the shipped one for the architecture")
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
    p.add_argument("--force_think", action="store_true", help="start the answer with <think> (reasoning models)")
    p.add_argument("--chunk_size", type=int, default=8192, help="prompt tokens per prefill forward")
    p.add_argument("--cache_lens", type=int, default=8192, help="token slots of the KV cache")
    p.add_argument("--device", default=None, help="device of the non-expert parts (default: cuda if present, else cpu)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--repetition_penalty", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return p.parse_args(argv)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def read_message(prompt: str = "Chat: ") -> str | None:
    """One message from the terminal; None at end of input. \"\"\" opens a multi-line message."""
    try:
        line = input(prompt)
    except EOFError:
        return None
    if not line.lstrip().startswith('"""'):
        return line
    lines = [line.lstrip()[3:]]
    while not lines[-1].rstrip().endswith('"""'):
        try:
            lines.append(input(""))
        except EOFError:
            break
    text = "\n".join(lines).rstrip()
    return text.removesuffix('"""')


def prompt_ids(tokenizer, message: str, force_think: bool) -> list[int]:
    """The chat template applied to one user message (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)
        if force_think:
            text += "<think>\n"
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(message + ("<think>\n" if force_think else ""))["input_ids"]


def answer(engine, tokenizer, message: str, args, params, out=sys.stdout) -> None:
    """Stream one answer to `out`, then the timing lines."""
    generation = engine.generate(prompt_ids(tokenizer, message, args.force_think), params, args.max_new_tokens,
                                 stop=args.stop)
    if args.force_think:
        out.write("<think>\n")
    for piece in generation:
        out.write(piece)
        out.flush()
    out.write("\n")
    if generation.finish_reason == "cache_full":
        out.write(f"[stopped: the KV cache is full ({engine.cache.capacity} tokens); raise --cache_lens]\n")
    out.write("\n".join(generation.stats.lines()) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .cache import CacheFullError
    from .engine.generate import Engine
    from .engine.sampling import SamplingParams
    from .loader import freeze_heap, load_model

    try:
        gguf_path, model_path = args.gguf_path, args.model_path
        if gguf_path is None and model_path is None:
            from .demo import DEMO_GGUF, DEMO_HF_DIR
            gguf_path, model_path = DEMO_GGUF, DEMO_HF_DIR
            print(f"no --gguf_path: chatting with the bundled demo model ({Path(gguf_path).name}, a 13M-parameter "
                  f"DeepSeek-V3-architecture MoE that continues English text)", file=sys.stderr)
        elif gguf_path is None:
            raise ValueError("--gguf_path is required with --model_path (the weights live in GGUF or safetensors files)")
        if model_path is not None and not Path(model_path).is_dir():
            raise FileNotFoundError(f"--model_path {str(model_path)!r} is not a directory")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(gguf_path, model_path, args.optimize_config_path, default_device=device,
                            cpu_infer=args.cpu_infer, cache_lens=args.cache_lens)
        freeze_heap()
        if args.prefill_gpu_threshold is not None:
            loaded.model.kt_context.prefill_gpu_threshold = args.prefill_gpu_threshold
        if loaded.tokenizer is None:
            raise ValueError(f"transformers cannot build the tokenizer of {gguf_path}; pass --model_path with the "
                             f"model's tokenizer files")
        if args.mode == "long_context":
            _absorb_prefill(loaded.model)
        engine = Engine(loaded.model, loaded.tokenizer, cache_lens=args.cache_lens, chunk_size=args.chunk_size,
                        use_cuda_graph=args.use_cuda_graph)
        gen_config = getattr(loaded.model, "generation_config", None)
        # a model that says nothing about sampling gets a usual chat default, not temperature 1
        overrides = {} if getattr(gen_config, "temperature", None) is not None else {"temperature": 0.7, "top_p": 0.9}
        flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                 "repetition_penalty": args.repetition_penalty, "seed": args.seed}
        overrides |= {k: v for k, v in flags.items() if v is not None}
        if args.greedy:
            overrides["do_sample"] = False
        params = SamplingParams.from_generation_config(gen_config, **overrides)

        once = args.prompt
        if once is None and args.prompt_file is not None:
            once = Path(args.prompt_file).read_text()
        if once is None and not sys.stdin.isatty():
            once = sys.stdin.read()
        if once is not None:
            if not once.strip():
                raise ValueError("the prompt is empty")
            answer(engine, loaded.tokenizer, once, args, params)
            return 0
        while True:
            message = read_message()
            if message is None:
                print()
                return 0
            if not message.strip():
                continue
            try:
                answer(engine, loaded.tokenizer, message, args, params)
            except KeyboardInterrupt:  # Ctrl-C stops this answer; Ctrl-C at the prompt (or Ctrl-D) ends the chat
                print("\n[interrupted]", flush=True)
            except CacheFullError as e:  # this message is too long; the chat goes on
                print(f"error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, CacheFullError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _absorb_prefill(model: torch.nn.Module) -> None:
    import dataclasses

    from .operators.attention import KDeepseekV2Attention
    for m in model.modules():
        if isinstance(m, KDeepseekV2Attention):
            m.options = dataclasses.replace(m.options, absorb_for_prefill=True)


if __name__ == "__main__":
    sys.exit(main())
