"""Upstream KTransformers' command-line flags that are spelled otherwise here, or have no
counterpart: a renamed one is passed on under its name here, the others are dropped (with their
value); each gets one line on stderr saying so, and an upstream command line runs as it is."""
from __future__ import annotations

import sys

_NO_SCHEDULER = "no effect: this server schedules in-process (continuous batching), with no balance_serve process"
_LOGS = "no effect: messages go to stderr"

SERVER_RENAMES = {"--model_dir": "--model_path", "--total_context": "--cache_lens",
                  "--max_response_tokens": "--max_new_tokens"}
SERVER_FLAGS = {
    "--web": "no effect: the web chat page is always served at /",
    "--backend_type": "no effect: one engine serves every request",
    "--use_cuda_graph": "no effect: decode runs in CUDA graphs on a GPU",
    "--cache_q4": "no effect: the KV cache is kept in the model's dtype",
    "--ssl_keyfile": "no effect: put a TLS proxy in front of the server",
    "--ssl_certfile": "no effect: put a TLS proxy in front of the server",
    "--sched_strategy": _NO_SCHEDULER, "--sched_port": _NO_SCHEDULER, "--sched_metrics_port": _NO_SCHEDULER,
    "--kvc2_metrics_port": _NO_SCHEDULER, "--memory_gpu_only": _NO_SCHEDULER, "--utilization_percentage": _NO_SCHEDULER,
    "--gpu_memory_size": "no effect: the KV cache is sized by --cache_lens",
    "--kvc2_config_dir": "use --prefix_cache_dir (the prefix cache's disk tier)",
    "--log_dir": _LOGS, "--log_file": _LOGS, "--log_level": _LOGS, "--backup_count": _LOGS,
    "--temperature": "no effect: each request's temperature, else the model's generation_config",
    "--top_p": "no effect: each request's top_p, else the model's generation_config",
    "--force_think": "no effect on the server: the chat template decides how an answer starts",
}
CHAT_FLAGS = {
    "--q4_gguf_path": "no effect: --mode long_context keeps the cache in latent form instead",
}


def drop_upstream_flags(argv: list[str], table: dict[str, str], renames: dict[str, str] | None = None) -> list[str]:
    """argv with the flags of `renames` under their names here and without those of `table` (nor
    the value after each, where it is not another flag), each noted on stderr."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if renames and name in renames:
            print(f"note: {name} (an upstream KTransformers flag) is {renames[name]} here", file=sys.stderr)
            kept.append(renames[name] + arg[len(name):])
            i += 1
            continue
        if name not in table:
            kept.append(arg)
            i += 1
            continue
        print(f"note: {name} (an upstream KTransformers flag): {table[name]}", file=sys.stderr)
        i += 1
        if "=" not in arg and i < len(argv) and not argv[i].startswith("--"):
            i += 1  # its value
    return kept
