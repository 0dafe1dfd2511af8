"""A small fine-tuning set that ships with Python: the Zen of Python (the standard library's
`this` module, under the PSF licence), as prompt/completion records, each aphorism its own.

    python -m ktransformers.train.zen OUT_DIR   # OUT_DIR/{train,heldout}.jsonl, {train,heldout}_pairs.jsonl

Every fourth aphorism is held out, so that a run shows whether the adapter learned the set's
form rather than its lines. The preference pairs (for --dpo) choose each aphorism over the same
words in reverse order.
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


PROMPT = "Give me a line of the Zen of Python."


def write(out_dir: str | Path) -> tuple[Path, ...]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = tuple(out / name for name in ("train.jsonl", "heldout.jsonl", "train_pairs.jsonl", "heldout_pairs.jsonl"))
    files = [open(p, "w") for p in paths]
    try:
        for i, line in enumerate(aphorisms()):
            held = i % 4 == 3
            files[held].write(json.dumps({"prompt": PROMPT, "completion": line}) + "\n")
            reversed_words = " ".join(reversed(line.split()))
            files[2 + held].write(json.dumps({"prompt": PROMPT, "chosen": line, "rejected": reversed_words}) + "\n")
    finally:
        for f in files:
            f.close()
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ktransformers.train.zen OUT_DIR")
    for path in write(sys.argv[1]):
        print(path)
