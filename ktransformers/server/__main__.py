"""python -m ktransformers.server: serve a model over OpenAI- and Ollama-compatible HTTP APIs.

    python -m ktransformers.server --gguf_path M.gguf [--model_path DIR] [--optimize_config_path R.yaml]
        [--host 127.0.0.1] [--port 10002] [--max_batch_size 8] [--cache_lens 8192] [--api_key KEY]

Without model flags it serves the bundled demo model. Binds to 127.0.0.1 unless --host says
otherwise. Needs the server extra: pip install -e ".[server]".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktransformers.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_path", help="HF directory (config, tokenizer), or a repo id in the local Hugging Face cache; "
                                        "optional when the GGUF carries them")
    p.add_argument("--gguf_path", help="GGUF file or directory (default: the bundled demo model)")
    p.add_argument("--optimize_config_path", help="rule file (default: the shipped one for the architecture)")
    p.add_argument("--lora_path", help="a LoRA adapter (peft's directory, as python -m ktransformers.sft saves it), "
                                       "merged into the weights it adapts at load")
    p.add_argument("--model_name", help="the name clients use (default: the GGUF's file name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=10002)
    p.add_argument("--max_batch_size", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max_queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--cache_lens", type=int, default=8192, help="KV cache token slots, shared by all requests")
    p.add_argument("--chunk_size", type=int, default=512, help="prefill tokens per step")
    p.add_argument("--max_new_tokens", type=int, default=512, help="default max_tokens")
    p.add_argument("--cpu_infer", type=int, help="CPU kernel threads")
    p.add_argument("--device", help="device of the non-expert parts (default: cuda if present)")
    p.add_argument("--api_key", help="require Authorization: Bearer KEY")
    p.add_argument("--max_request_mb", type=float, default=16.0, help="largest request body, MiB (larger: 413)")
    p.add_argument("--allowed_hosts", nargs="+", metavar="NAME",
                   help="Host header names to answer (default on a loopback --host: localhost, 127.0.0.1, ::1, "
                        "against DNS rebinding; elsewhere: any)")
    p.add_argument("--chat_template", help="a Jinja chat template (a file, or the template itself) instead of the model's")
    p.add_argument("--tool_call_parser", default="auto",
                   choices=["auto", "hermes", "deepseek_v3", "kimi_k2", "glm45", "minimax_m2"],
                   help="the tool-call format of the model's answers (auto: from its chat template and architecture)")
    p.add_argument("--no_prefix_cache", action="store_true", help="do not keep finished requests' cache for reuse")
    p.add_argument("--prefix_cache_ram", type=float, default=1.0,
                   help="GiB of CPU RAM for prefix pages evicted from the KV cache (0: none)")
    p.add_argument("--prefix_cache_dir", help="directory for prefix pages evicted from RAM (the disk tier)")
    p.add_argument("--prefix_cache_disk", type=float, default=10.0, help="GiB the disk tier may use")
    return p


def make_server(args):
    """(app, scheduler) for parsed arguments; loads the model."""
    import torch

    from ..engine.generate import Engine
    from ..engine.sampling import SamplingParams
    from ..loader import freeze_heap, load_model
    from .app import create_app
    from .scheduler import Scheduler
    gguf_path, model_path = args.gguf_path, args.model_path
    if gguf_path is None:
        from ..demo import DEMO_GGUF, DEMO_HF_DIR
        gguf_path, model_path = DEMO_GGUF, model_path or DEMO_HF_DIR
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model(gguf_path, model_path, args.optimize_config_path, default_device=device,
                        cpu_infer=args.cpu_infer, cache_lens=args.cache_lens, lora_path=args.lora_path)
    freeze_heap()
    if args.chat_template:
        if loaded.tokenizer is None:
            raise ValueError("--chat_template: the model has no tokenizer to attach it to")
        template = Path(args.chat_template)
        loaded.tokenizer.chat_template = template.read_text() if template.is_file() else args.chat_template
    engine = Engine(loaded.model, loaded.tokenizer, cache_lens=args.cache_lens, chunk_size=args.chunk_size,
                    use_cuda_graph=device.startswith("cuda"), max_batch=args.max_batch_size)
    engine.warm_up(batch_sizes=range(1, args.max_batch_size + 1))
    from ..cache.prefix import PrefixStore
    store = PrefixStore(int(args.prefix_cache_ram * (1 << 30)), args.prefix_cache_dir,
                        int(args.prefix_cache_disk * (1 << 30)))
    scheduler = Scheduler(engine, loaded.tokenizer, max_batch=args.max_batch_size, max_queue=args.max_queue,
                          prefix_cache=not args.no_prefix_cache, prefix_store=store)
    name = args.model_name or Path(str(gguf_path)).stem
    defaults = SamplingParams.from_generation_config(getattr(loaded.model, "generation_config", None))
    app = create_app(scheduler, name, args.api_key, args.max_new_tokens, defaults,
                     max_body_bytes=int(args.max_request_mb * (1 << 20)), allowed_hosts=allowed_hosts(args),
                     tool_call_parser=args.tool_call_parser)
    return app, scheduler


def main(argv: list[str] | None = None) -> int:
    from ..upstream import SERVER_FLAGS, SERVER_RENAMES, drop_upstream_flags
    argv = drop_upstream_flags(list(sys.argv[1:] if argv is None else argv), SERVER_FLAGS, SERVER_RENAMES)
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print('error: the server needs its extra: pip install -e ".[server]"', file=sys.stderr)
        return 2
    if not args.max_request_mb > 0:
        print("error: --max_request_mb must be positive", file=sys.stderr)
        return 2
    try:  # the port first: a taken one is an error before minutes of loading, not after
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        app, scheduler = make_server(args)
    except (ValueError, FileNotFoundError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_requests()
    print(f"serving on http://{args.host}:{args.port} (OpenAI /v1, Anthropic /v1/messages, Ollama /api, metrics "
          f"/metrics, chat page /)", flush=True)
    try:
        uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    finally:
        scheduler.close()
        sock.close()
    return 0


def log_requests() -> None:
    """The request log (metrics.py: a line per finished request) to stderr, as uvicorn's own."""
    import logging
    logger = logging.getLogger("ktransformers.server")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


HEADER_TIMEOUT_S = 30.0  # the longest a connection may take to send a request's line and headers


def uvicorn_config(app, **kwargs):
    """uvicorn's Config for the app: its h11 protocol with a time limit on each request's headers."""
    import uvicorn
    return uvicorn.Config(app, log_level="warning", http=header_timeout_protocol(), **kwargs)


def header_timeout_protocol():
    """uvicorn's h11 protocol, closing a connection whose request line and headers are not all in
    HEADER_TIMEOUT_S after it opened or after its last response: uvicorn itself waits forever for
    them (its keep-alive timer stops at the first byte), so a client sending them a byte at a time
    holds a connection open for good. (The body has its own limit: app.BODY_TIMEOUT_S.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete  # (no request being answered)
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def allowed_hosts(args) -> tuple[str, ...] | None:
    """The Host names to answer: --allowed_hosts, else the loopback names on a loopback --host
    (where DNS rebinding could reach it from a browser), else any (None)."""
    from .app import LOOPBACK_NAMES
    if args.allowed_hosts:
        return tuple(args.allowed_hosts)
    return LOOPBACK_NAMES if args.host in LOOPBACK_NAMES or args.host.startswith("127.") else None


def listening_socket(host: str, port: int):
    """A socket bound to host:port and listening (what uvicorn would open), made before the model loads."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    sys.exit(main())
