"""End-to-end prefill and decode speed of a model and rule file, beside llama.cpp on the same GGUF.

    python -m ktransformers.bench.synth --model qwen3-30b-a3b --layers 4 --vocab 32000 --out /tmp/q3.gguf
    python -m ktransformers.bench.decode --gguf_path /tmp/q3.gguf --threads 2

Prefill: one prompt of random token ids, fed in one chunk (tok/s = prompt tokens / time to the
first logits). Decode: `--decode` single-token steps after it (tok/s = steps / time). The floor
is decode at memory bandwidth: the bytes one decode step must read (every dense tensor, the
lm_head, and top_k/n_experts of each expert tensor) over the streaming bandwidth measured in the
same run. llama.cpp (llama-cpp-python) runs the same file, threads and token counts after ours,
in a child process (`--llama-python` picks the interpreter that has it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PEER_SCRIPT = r"""
import json, sys, random, time
import llama_cpp
path, threads, prompt, decode, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prompt + decode + 16,
                      n_batch=max(prompt, 32), n_ubatch=max(prompt, 32), verbose=False)
rng = random.Random(0)
vocab = llm.n_vocab()
rows = []
for _ in range(repeats):  # wall clock around llama.cpp's own decode calls, as for ours
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    tokens = [rng.randrange(3, vocab) for _ in range(prompt + decode)]
    t0 = time.perf_counter()
    llm.eval(tokens[:prompt])
    llama_cpp.llama_synchronize(llm._ctx.ctx)
    t1 = time.perf_counter()
    for token in tokens[prompt:]:
        llm.eval([token])
    llama_cpp.llama_synchronize(llm._ctx.ctx)
    t2 = time.perf_counter()
    rows.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
print(json.dumps({"version": llama_cpp.__version__, "rows": rows}))
"""


def layer_bytes(files, config) -> tuple[float, float, list[tuple[float, float]]]:
    """(expert bytes, other bytes) one decode step reads from the GGUF `files` outside the
    layers, and per layer: expert tensors top_k/E of them, dense tensors whole, one embedding
    row (not the table)."""
    from ..weights.gguf_config import routed_experts
    experts = routed_experts(config)
    outside = [0.0, 0.0]
    layers = [[0.0, 0.0] for _ in range(config.num_hidden_layers)]
    for name, info in files.tensors.items():
        nbytes = info.data.nbytes / info.shape[0] if name == "token_embd.weight" else info.data.nbytes
        into = layers[int(name.split(".")[1])] if name.startswith("blk.") else outside
        if "_exps." in name:
            into[0] += nbytes * config.num_experts_per_tok / experts
        else:
            into[1] += nbytes
    return outside[0], outside[1], [tuple(x) for x in layers]


def step_bytes(files, config) -> tuple[float, float]:
    """(expert bytes, other bytes) one decode step reads (layer_bytes summed)."""
    expert, other, per = layer_bytes(files, config)
    for e, d in per:
        expert, other = expert + e, other + d
    return expert, other


def decode_bytes(files, config) -> int:
    return int(sum(step_bytes(files, config)))


def measure_ours(args, config) -> tuple[list[dict], object]:
    from ..engine.generate import Engine
    from ..loader import freeze_heap, load_model
    loaded = load_model(args.gguf_path, args.model_path, args.optimize_config_path, progress=not args.json,
                        cpu_infer=args.threads, tokenizer=False, default_device=args.device)
    freeze_heap()
    engine = Engine(loaded.model, None, cache_lens=args.prompt + args.decode + 16, page_size=256,
                    chunk_size=max(args.prompt, 1), use_cuda_graph=not args.no_cuda_graph)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    runs = []
    for _ in range(args.repeats):
        prompt = torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
        steps = torch.randint(3, vocab, (args.decode,), generator=gen).tolist()
        seq = engine.new_sequence()
        t0 = time.perf_counter()
        engine.prefill(seq, prompt)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for token in steps:
            engine.decode(seq, token)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.release(seq)
        runs.append({"prefill_s": t1 - t0, "decode_s": t2 - t1})
    return runs, loaded


class _Timed:
    """Stands in for a kernel object (or module) of a layer's CPU decode plan: the calls of the
    methods named add their time to spent[label]; everything else passes through."""

    def __init__(self, inner, label: str, spent: dict, methods: tuple[str, ...]):
        self._inner, self._label, self._spent, self._methods = inner, label, spent, methods

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._spent[self._label] += time.perf_counter() - t0
        return timed

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")(*args, **kwargs)


# the CPU decode plan's kernels (operators.layer.CpuDecode fields) and the parts they are timed as
PLAN_PARTS = (("q", "forward", "q_proj"), ("k", "forward", "k_proj"), ("v", "forward", "v_proj"),
              ("o", "forward", "o_proj"), ("runtime", "rope_write_attend_gqa", "attention (RoPE, cache write, attend)"),
              ("ext", "rms_norm", "RMS norms"), ("router", "forward", "router"), ("moe", "forward", "routed experts"),
              ("shared", "__call__", "shared experts"))


def _time_plan_parts(layer, spent: dict):
    """Swap `layer`'s CPU decode plan for one whose kernels time their calls (per PLAN_PARTS, all
    layers summed under one label each): the plan it had, to put back, or None where it has no
    CPU decode plan (nothing swapped)."""
    import dataclasses
    plan = layer.plan
    p = plan.cpu_decode
    if p is None:
        return None
    timed = {field: _Timed(getattr(p, field), f"cpu_decode: {label}", spent, (method,))
             for field, method, label in PLAN_PARTS if getattr(p, field) is not None}
    layer._plan = dataclasses.replace(plan, cpu_decode=dataclasses.replace(p, **timed))
    return plan


def decode_breakdown(loaded, engine, config, steps: int = 32, prompt: int = 64) -> list[tuple[str, float]]:
    """ms per decoded token spent in each kind of operator (forward hooks; nested modules count in
    their parents too: self_attn includes its projections), the decoder layers' steps together,
    and the whole step. The engine calls a layer's step(), not its forward: that is timed by a
    wrapper. A layer on the CPU decode plan calls its kernels without modules, so no hooks: each
    kernel's calls are timed instead (`cpu_decode: ...` rows, PLAN_PARTS)."""
    import collections

    from ..operators.base import BaseInjectedModule
    from ..operators.layer import KDecoderLayer
    spent: dict[str, float] = collections.defaultdict(float)
    handles = []
    wrapped = []
    planned = []
    for name, module in loaded.model.named_modules():
        if isinstance(module, KDecoderLayer):
            plan = _time_plan_parts(module, spent)
            if plan is not None:
                planned.append((module, plan))
            def step(*args, _step=module.step, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _step(*args, **kwargs)
                finally:
                    spent["KDecoderLayer steps (all layers)"] += time.perf_counter() - t0
            module.step = step
            wrapped.append(module)
        if not isinstance(module, BaseInjectedModule):
            continue
        label = f"{type(module).__name__} {name.rsplit('.', 1)[-1]}"

        def pre(m, args, label=label):
            m._bench_t0 = time.perf_counter()

        def post(m, args, out, label=label):
            spent[label] += time.perf_counter() - m._bench_t0
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(3, 3 + prompt)))
    spent.clear()
    t0 = time.perf_counter()
    for token in range(steps):
        engine.decode(seq, 3 + token % (config.vocab_size - 3))
    total = time.perf_counter() - t0
    engine.release(seq)
    for h in handles:
        h.remove()
    for module in wrapped:
        del module.step  # (the class's method again)
    for module, plan in planned:
        module._plan = plan
    rows = sorted(((k, v / steps * 1e3) for k, v in spent.items()), key=lambda kv: -kv[1])
    return rows + [("whole decode step", total / steps * 1e3)]


def measure_llamacpp(args) -> dict | None:
    python = args.llama_python or sys.executable
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, check=False)
    if probe.returncode != 0:
        return None
    out = subprocess.run([python, "-c", PEER_SCRIPT, str(args.gguf_path), str(args.threads), str(args.prompt),
                          str(args.decode), str(args.repeats)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"llama.cpp failed on {args.gguf_path}: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(name: str, runs: list[dict], args, floor_tok_s: float, stream: float, version: str = "") -> dict:
    prefill = statistics.median(args.prompt / r["prefill_s"] for r in runs)
    decode = statistics.median(args.decode / r["decode_s"] for r in runs)
    return {"engine": name, "version": version, "gguf": str(args.gguf_path), "threads": args.threads,
            "prompt_tokens": args.prompt, "decode_tokens": args.decode, "prefill_tok_s": prefill, "decode_tok_s": decode,
            "decode_floor_tok_s": floor_tok_s, "stream_gbps": stream, "decode_ratio": decode / floor_tok_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", required=True)
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cpu", help="default device of the model (cuda: the shipped GPU rule file "
                   "when --optimize_config_path is not given, bf16 weights)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--decode", type=int, default=64, help="decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on the GPU (no CUDA graphs)")
    p.add_argument("--llama-python", help="python with llama-cpp-python installed (default: this one)")
    p.add_argument("--stream-gib", type=float, default=2.0)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--breakdown", action="store_true", help="also print (stderr) where a decode step's time goes")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.decode < 1 or args.repeats < 1:
        p.error("--prompt, --decode and --repeats must be positive")
    if not Path(args.gguf_path).exists():
        p.error(f"--gguf_path {args.gguf_path} does not exist")

    from ..loader import load_config
    from ..weights.gguf import GGUFFileSet
    files = GGUFFileSet(args.gguf_path)
    config = load_config(args.model_path, args.gguf_path, files)
    step_bytes = decode_bytes(files, config)
    torch.set_num_threads(args.threads)
    runs, loaded = measure_ours(args, config)
    if args.breakdown:
        from ..engine.generate import Engine
        engine = Engine(loaded.model, None, cache_lens=args.prompt + 64, chunk_size=512)
        for label, ms in decode_breakdown(loaded, engine, config, prompt=args.prompt):
            print(f"{label:<50} {ms:8.3f} ms/token", file=sys.stderr)
    # one probe, after every timed run: a buffer of its own, freed before the peers run
    stream = loaded.model.kt_context.cpu_runtime().stream_gbps(args.stream_gib)
    floor = stream * 1e9 / step_bytes
    del loaded
    rows = [summarise("ktransformers", runs, args, floor, stream)]
    if not args.no_peer:
        peer = measure_llamacpp(args)
        if peer is not None:
            rows.append(summarise("llama.cpp", peer["rows"], args, floor, stream, peer["version"]))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{Path(args.gguf_path).name}: {config.model_type}, {config.num_hidden_layers} layers, "
          f"{step_bytes / 1e6:.1f} MB read per decoded token, stream {stream:.1f} GB/s, "
          f"{args.threads} threads")
    print(f"{'engine':<14} {'prefill tok/s':>13} {'decode tok/s':>12} {'floor tok/s':>11} {'ratio':>5}")
    for row in rows:
        print(f"{row['engine']:<14} {row['prefill_tok_s']:>13.1f} {row['decode_tok_s']:>12.1f} "
              f"{row['decode_floor_tok_s']:>11.1f} {row['decode_ratio']:>5.2f}")
    if len(rows) == 2:
        print(f"ours / llama.cpp: prefill {rows[0]['prefill_tok_s'] / rows[1]['prefill_tok_s']:.2f}x, "
              f"decode {rows[0]['decode_tok_s'] / rows[1]['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
