"""A small fine-tuning set that ships with Python: the Zen of Python (the standard library's
`this` module, under the PSF licence), as prompt/completion records, each aphorism its own.

    python -m ktransformers.train.zen OUT_DIR   # OUT_DIR/train.jsonl, OUT_DIR/heldout.jsonl

Every fourth aphorism is held out, so that a run shows whether the adapter learned the set's
form rather than its lines.
"""
from __future__ import annotations

import codecs
import contextlib
import io
import json
import sys
from pathlib import Path


def aphorisms() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # (importing `this` prints the text)
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


def write(out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held = out / "train.jsonl", out / "heldout.jsonl"
    with open(train, "w") as t, open(held, "w") as h:
        for i, line in enumerate(aphorisms()):
            record = {"prompt": "Give me a line of the Zen of Python.", "completion": line}
            (h if i % 4 == 3 else t).write(json.dumps(record) + "\n")
    return train, held


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ktransformers.train.zen OUT_DIR")
    for path in write(sys.argv[1]):
        print(path)
