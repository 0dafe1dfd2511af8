"""The `ktransformers` console script: `ktransformers chat ...` (= python -m ktransformers.local_chat)
and `ktransformers serve ...` (= python -m ktransformers.server). Flags with no command first
(`ktransformers --model_path ... --gguf_path ... --port 10002`, upstream's console script) serve."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"chat": "ktransformers.local_chat", "serve": "ktransformers.server.__main__"}
    if argv and argv[0].startswith("--") and argv[0] not in ("-h", "--help"):
        argv = ["serve"] + argv  # upstream's `ktransformers --model_path ... --port ...` started its server
    if not argv or argv[0] not in commands:
        print("usage: ktransformers {chat,serve} [flags]   (--help after a command lists its flags)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib
    module = importlib.import_module(commands[argv[0]])
    result = module.main(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
