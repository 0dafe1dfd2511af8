"""The GGUF reader under mutated files: a tiny Qwen3-MoE GGUF has bytes of its header, metadata
and tensor directory overwritten at random (seeded), and each file is loaded through the shipped
CPU rule file and run, in a subprocess with limits on memory and time (a crash or a hang there is
a failure, not a lost test run). Every outcome must be one of:
- a clean error: a ValueError or OSError whose message names the file;
- logits equal to the unmutated file's;
- for a mutation inside the metadata's keys and values only, finite logits (a changed epsilon or
  RoPE base, say, is another valid model).
"""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import tiny_model, train_tokenizer

from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import tokenizer_metadata, write_gguf

MUTATIONS = 400
MEMORY_LIMIT = 4 << 30
TIME_LIMIT_S = 900

WORKER = textwrap.dedent('''
    import json, resource, sys, traceback
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    import torch
    from ktransformers.loader import load_model
    ids = torch.tensor([[3, 17, 99, 250, 4, 61, 7]])

    def run(path):
        lm = load_model(path, tokenizer=False, progress=False, dtype=torch.float32, cpu_infer=1)
        with torch.inference_mode():
            return lm.model(ids).logits[0]

    reference = run(sys.argv[1])
    torch.save(reference, sys.argv[1] + ".pt")
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps({{"case": case["i"], "start": True}}), flush=True)
        try:
            logits = run(case["path"])
        except (ValueError, OSError) as e:
            outcome = {{"error": type(e).__name__, "message": str(e)[:300]}}
        except Exception as e:  # an unchecked input reached code that did not expect it
            outcome = {{"unclean": type(e).__name__, "message": str(e)[:300], "trace": traceback.format_exc()[-800:]}}
        else:
            outcome = {{"finite": bool(torch.isfinite(logits).all()), "equal": bool(torch.equal(logits, reference))}}
        print(json.dumps({{"case": case["i"], **outcome}}), flush=True)
''').format(limit=MEMORY_LIMIT)


def regions(path) -> tuple[int, list[tuple[int, int]]]:
    """(where the tensor data starts, the byte spans of the metadata's key-value pairs)."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    spans = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # (the header: magic, version, counts)
        end = max(int(p.nbytes + (p.ctypes.data - reader.data.ctypes.data)) for p in field.parts)
        spans.append((field.offset, end))
    return int(reader.data_offset), spans


def mutate(data: bytes, rng: random.Random, data_start: int, spans: list[tuple[int, int]]) -> tuple[bytes, int]:
    """One to four bytes replaced by random ones, or by values that tend to break readers (0, 0xff,
    a power of two): half of the time at the start of a metadata key-value pair (its key's length,
    its type, an array's length), else anywhere before the tensor data."""
    out = bytearray(data)
    at = rng.choice(spans)[0] + rng.randrange(12) if rng.random() < 0.5 else rng.randrange(0, data_start - 4)
    n = rng.choice((1, 1, 2, 4))
    pick = rng.random()
    if pick < 0.2:
        fill = bytes(n)
    elif pick < 0.4:
        fill = b"\xff" * n
    elif pick < 0.5:
        fill = (1 << rng.randrange(8 * n)).to_bytes(n, "little")
    else:
        fill = bytes(rng.randrange(256) for _ in range(n))
    out[at:at + n] = fill
    return bytes(out), at


@pytest.mark.slow
def test_mutated_gguf_headers_fail_cleanly_or_load_the_same(tmp_path):
    model = tiny_model("qwen3_moe", layers=1)
    original = tmp_path / "m.gguf"
    write_gguf(original, model.config, model.state_dict(), types=GGMLType.Q8_0,
               extra_metadata=tokenizer_metadata(train_tokenizer(320)))
    data = original.read_bytes()
    data_start, kv_spans = regions(original)
    rng = random.Random(1234)
    cases, lines = {}, []
    for i in range(MUTATIONS):
        mutated, at = mutate(data, rng, data_start, kv_spans)
        path = tmp_path / f"fuzz{i}.gguf"
        path.write_bytes(mutated)
        cases[i] = dict(path=str(path), at=at, in_kv=any(a <= at < b for a, b in kv_spans))
        lines.append(json.dumps({"i": i, "path": str(path)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    try:
        run = subprocess.run([sys.executable, "-c", WORKER, str(original)], input="\n".join(lines) + "\n",
                             capture_output=True, text=True, timeout=TIME_LIMIT_S, env=env)
    except subprocess.TimeoutExpired as e:
        started = [json.loads(line) for line in (e.stdout or b"").decode().splitlines() if '"start"' in line]
        last = cases[started[-1]["case"]] if started else None
        pytest.fail(f"the worker hung (over {TIME_LIMIT_S} s), last on {last}")
    results = [json.loads(line) for line in run.stdout.splitlines()]
    starts = [r for r in results if r.get("start")]
    done = {r["case"]: r for r in results if not r.get("start")}
    assert run.returncode == 0, (f"the worker died ({run.returncode}) on mutation "
                                 f"{cases[starts[-1]['case']] if starts else None}: {run.stderr[-1500:]}")
    assert len(done) == MUTATIONS
    failures = []
    for i, r in done.items():
        case = cases[i]
        if "unclean" in r:
            failures.append(f"{case}: unclean {r['unclean']}: {r['message']}\n{r['trace']}")
        elif "error" in r and os.path.basename(case["path"]) not in r["message"]:
            failures.append(f"{case}: {r['error']} without the file's name: {r['message']}")
        elif "finite" in r and not r["finite"]:
            failures.append(f"{case}: logits not finite")
        elif "equal" in r and not r["equal"] and not case["in_kv"]:
            failures.append(f"{case}: other logits from a mutation outside the metadata values")
    errors = sum("error" in r for r in done.values())
    assert not failures, f"{len(failures)} of {MUTATIONS} mutations:\n" + "\n".join(failures[:10])
    assert errors > MUTATIONS // 4  # (the mutations do reach the checks)
    assert torch.isfinite(torch.load(str(original) + ".pt")).all()
