"""Hybrid GPU + CPU end to end: prefill at several prompt lengths and decode, against the decode
roofline of the same run and llama.cpp (experts on the CPU, `-ot exps=CPU`) on the same file.

    python -m ktransformers.bench.synth --model qwen3-30b-a3b --vocab 32000 --out /tmp/q3.gguf  # 48 layers
    python -m ktransformers.bench.e2e --gguf_path /tmp/q3.gguf --threads 16 [--llama-bench PATH]

Ours: the shipped GPU rule file for the architecture (or --optimize_config_path), bf16 on the GPU,
CUDA-graph decode. Prefill tok/s = prompt tokens / time to the first logits (one chunk of
--chunk_size; each length run once untimed first, as llama-bench warms up); decode tok/s over
--decode greedy steps (sampled ones with --temperature) after a 512-token prompt, as generation
runs them (Engine.decode_tokens: each step issued before the previous one's token is read back).
Roofline: a decode step reads top_k/E of every expert tensor from RAM (at the CPU streaming
bandwidth measured in the same run: the mean of the probes right before and after each timed
decode) and every other tensor once from GPU memory (at the GPU's
device-copy bandwidth); the floor time is the sum, and `ratio` = measured / roofline tok/s.
llama.cpp: `llama-bench -ngl 99 -ot exps=CPU -fa 1 -ub 2048 -b 2048` on the same file and threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import sync
from .decode import layer_bytes
from .moe import stream_gbps

PROBE_GIB = 2.0  # each stream probe's buffer (best of five reads)
DECODE_PROMPT = 512  # the timed decode's prompt length


def gpu_copy_gbps() -> float:
    from .gpu import copy_gbps
    return copy_gbps()


def hot_split(files, config, hot: dict[int, int]) -> tuple[float, float]:
    """(bytes from RAM, bytes from the GPU) of a decode step when layer i keeps `hot[i]` of its
    experts on the GPU: with routing spread evenly, that share of its expert reads moves there."""
    from ..weights.gguf_config import routed_experts
    experts = routed_experts(config)
    out_e, out_d, per = layer_bytes(files, config)
    ram, gpu = out_e, out_d
    for i, (e, d) in enumerate(per):
        share = hot.get(i, 0) / experts
        ram += e * (1 - share)
        gpu += d + e * share
    return ram, gpu


def extrapolated_bytes(files, config, layers: int, hot: dict[int, int] | None = None) -> tuple[float, float]:
    """(bytes from RAM, bytes from the GPU) of a decode step of the same model with `layers`
    layers: the file's layers without routed experts (DeepSeek's first dense ones) kept, its MoE
    layers' mean repeated for the rest; with `hot`, the MoE layers' mean hot share of the expert
    reads comes from the GPU."""
    from ..weights.gguf_config import routed_experts
    out_e, out_d, per = layer_bytes(files, config)
    moe = [x for x in per if x[0] > 0]
    dense = [x for x in per if x[0] == 0]
    n = layers - len(dense)
    mean_e = sum(x[0] for x in moe) / len(moe)
    mean_d = sum(x[1] for x in moe) / len(moe)
    expert, other = out_e + n * mean_e, out_d + sum(x[1] for x in dense) + n * mean_d
    share = sum((hot or {}).values()) / len(moe) / routed_experts(config)
    return expert * (1 - share), other + expert * share


def hot_experts_per_layer(model) -> dict[int, int]:
    """{layer: experts kept on the GPU} of a loaded model (num_gpu_experts of its experts ops)."""
    from ..operators.experts import KTransformersExperts
    return {int(m.key.split(".")[2]): m.options.num_gpu_experts for m in model.modules()
            if isinstance(m, KTransformersExperts) and m.options.num_gpu_experts}


def layerwise_path(model) -> str | None:
    """How layer-wise prefill sends the experts to the GPU: "tiles" (the CPU kernel's tiles read in
    place), "staged" (the GGUF's bytes through pinned chunks), "mixed", or None (off)."""
    from ..operators.experts import KTransformersExperts
    paths = {"tiles" if m.layerwise.tiles is not None else "staged" for m in model.modules()
             if isinstance(m, KTransformersExperts) and m.layerwise is not None}
    return None if not paths else paths.pop() if len(paths) == 1 else "mixed"


def pcie_shares(model) -> dict[int, int]:
    """{layer: experts of each decode token the GPU computes over the bus} (pcie_experts in use)."""
    from ..operators.experts import KExpertsCPU, KTransformersExperts
    shares = {}
    for m in model.modules():
        op = m.ops.get("generate") if isinstance(m, KTransformersExperts) else None
        if isinstance(op, KExpertsCPU) and op.pcie is not None:
            shares[int(m.key.split(".")[2])] = op.spec.top_k - op.pcie.col0
    return shares


def measure_ours(args, config) -> dict:
    loaded, engine = _load_engine(args)
    gen = torch.Generator().manual_seed(0)
    prefill = {P: _prefill_tok_s(engine, args, P, config.vocab_size, gen) for P in args.prompts}
    runtime = loaded.model.kt_context.cpu_runtime()
    runs = [_timed_decode(engine, loaded.model, args, config.vocab_size, gen, runtime) for _ in range(args.repeats)]
    out = {"prefill": prefill, "decode": statistics.median(r["tok_s"] for r in runs), "loaded": loaded,
           "issue_us": statistics.median(r["issue_us"] for r in runs),
           "probes": [g for r in runs for g in r["probes"]]}
    split = [r["split"] for r in runs if r["split"] is not None]
    if split:
        out["cpu_call_us"] = statistics.median(s[0] for s in split)
        out["between_us"] = statistics.median(s[1] for s in split)
        out["layers_us"] = statistics.median(s[2] for s in split)  # a step's calls and the gaps between them
    return out


def _load_engine(args):
    from ..engine.generate import Engine
    from ..loader import freeze_heap, load_model
    loaded = load_model(args.gguf_path, args.model_path, _rule_file(args), progress=not args.json,
                        cpu_infer=args.threads, tokenizer=False, default_device="cuda")
    freeze_heap()
    if args.prefill_gpu_threshold is not None:
        from ..operators.experts import set_prefill_gpu_threshold
        set_prefill_gpu_threshold(loaded.model, args.prefill_gpu_threshold)
    if args.n_deferred_experts is not None:
        from ..operators.experts import set_expert_deferral
        set_expert_deferral(loaded.model, args.n_deferred_experts)
    # (the timed decode follows a prompt of DECODE_PROMPT tokens, whatever --prompts are)
    longest = max(max(args.prompts), DECODE_PROMPT + args.decode)
    engine = Engine(loaded.model, None, cache_lens=longest + 256, page_size=256,
                    chunk_size=args.chunk_size, use_cuda_graph=True, max_batch=1)
    return loaded, engine


def _rule_file(args):
    """The rule file to load: --optimize_config_path (default: the shipped GPU one), with every
    experts rule's pcie_experts set to --pcie_experts where given (written beside the run)."""
    if args.pcie_experts is None:
        return args.optimize_config_path
    import tempfile

    import yaml

    from ..loader import default_rule_file, load_config
    path = args.optimize_config_path or default_rule_file(load_config(args.model_path, args.gguf_path), gpu=True)
    rules = yaml.safe_load(Path(path).read_text())
    value = args.pcie_experts if args.pcie_experts == "auto" else int(args.pcie_experts)
    for rule in rules:
        replace = rule.get("replace") or {}
        if str(replace.get("class", "")).rsplit(".", 1)[-1] == "KTransformersExperts":
            replace.setdefault("kwargs", {})["pcie_experts"] = value
    out = Path(tempfile.mkdtemp(prefix="kt-e2e-")) / Path(path).name
    out.write_text(yaml.safe_dump(rules, sort_keys=False))
    return out


def _prefill_tok_s(engine, args, P: int, vocab: int, gen) -> float:
    """Median prefill tok/s of `args.repeats` random prompts of P tokens."""
    times = []
    for i in range(args.repeats + 1):  # the first run of each length is a warm-up (as llama-bench's)
        prompt = torch.randint(3, vocab, (P,), generator=gen).tolist()
        seq = engine.new_sequence()
        sync()
        t0 = time.perf_counter()
        engine.prefill(seq, prompt)
        sync()
        if i:  # (a length's first run may compile Triton kernels for its block sizes)
            times.append(time.perf_counter() - t0)
        engine.release(seq)
    return P / statistics.median(times)


def _timed_decode(engine, model, args, vocab: int, gen, runtime) -> dict:
    """One timed decode after a 512-token prompt: tok/s; us a step from its start until its work
    is enqueued; the stream probes (GB/s) right before and after; and from the doorbell's counters
    (us in a CPU experts call, us from a call's end to the next ring, us of a step's layers)."""
    seq = engine.new_sequence()
    engine.prefill(seq, torch.randint(3, vocab, (DECODE_PROMPT,), generator=gen).tolist())
    steps = torch.randint(3, vocab, (args.decode,), generator=gen).tolist()
    logits = engine.decode(seq, steps[0])  # (the first step captures the graph)
    sampler = _sampler(args, logits)
    sync()
    bell = model.kt_context.host_staging().doorbell  # (made when a graph first rings it)
    before = doorbell_counts(bell)
    probes = [stream_gbps(runtime, PROBE_GIB)]
    engine.step_times.reset()
    t0 = time.perf_counter()
    made = sum(1 for _ in engine.decode_tokens(seq, steps[1], args.decode - 1, sampler))  # as generation decodes
    sync()
    tok_s = made / (time.perf_counter() - t0)
    probes.append(stream_gbps(runtime, PROBE_GIB))
    times = engine.step_times
    split = None
    if bell is not None:
        served, busy, gaps, between = (a - b for a, b in zip(doorbell_counts(bell), before))
        split = (busy / max(served, 1) / 1e3, between / max(gaps, 1) / 1e3, (busy + between) / max(made, 1) / 1e3)
    engine.release(seq)
    return {"tok_s": tok_s, "issue_us": times.issue_s / max(times.steps, 1) * 1e6, "probes": probes, "split": split}


def _sampler(args, logits):
    """None (greedy), or with --temperature the sampler generation would use (no repetition penalty)."""
    if not args.temperature:
        return None
    from ..engine.sampling import Sampler, SamplingParams
    sampler = Sampler(SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0))
    sampler(logits)  # (its first draw on this GPU captures the draw's graph: once a process)
    return sampler


def doorbell_counts(bell) -> tuple[int, int, int, int]:
    """(calls served, ns in them, gaps, ns in the gaps) of the CPU experts' doorbell so far."""
    if bell is None:
        return 0, 0, 0, 0
    return bell.served, bell.busy_ns, bell.betweens, bell.between_ns


def measure_llama(args) -> dict | None:
    if not args.llama_bench:
        return None
    cmd = [args.llama_bench, "-m", str(args.gguf_path), "-ngl", "99", "-ot", "exps=CPU", "-t", str(args.threads),
           "-fa", "1", "-ub", "2048", "-b", "2048", "-p", ",".join(map(str, args.prompts)), "-n", str(args.decode),
           "-r", str(args.repeats), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"llama-bench failed: {out.stderr.strip().splitlines()[-3:]}")
        return None
    rows = json.loads(out.stdout)
    prefill = {r["n_prompt"]: r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"]}
    decode = next((r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"]), None)
    return {"prefill": prefill, "decode": decode, "build": rows[0].get("build_commit", "")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", required=True)
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--chunk_size", type=int, default=8192)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefill_gpu_threshold", type=int, help="override the rule file's (0: CPU experts only)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="decode sampled tokens at this temperature (0: greedy)")
    p.add_argument("--top_p", type=float, default=1.0, help="with --temperature: the nucleus kept")
    p.add_argument("--llama-bench", help="path of llama.cpp's llama-bench (CUDA build) to run beside ours")
    p.add_argument("--extrapolate", type=int, metavar="LAYERS",
                   help="also give decode tok/s for the same model with LAYERS layers (e.g. 61 for DeepSeek-V3), "
                        "at the fraction of the roofline measured here")
    p.add_argument("--pcie_experts", metavar="N|auto",
                   help="of each decode token's experts, the GPU computes N (or the rule files' 'auto' share) from "
                        "the CPU's copy over PCIe (set in every experts rule; 0: off; the header then adds the roofline "
                        "with the bus's bandwidth too)")
    p.add_argument("--n_deferred_experts", type=int, metavar="K",
                   help="defer each decode token's K lowest-weight experts of every MoE layer to the next layer's "
                        "(docs/rules.md; over the rule file's n_deferred_experts)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.pcie_experts is not None and args.pcie_experts != "auto" and not args.pcie_experts.isdigit():
        p.error(f"--pcie_experts must be a count or 'auto', got {args.pcie_experts!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.e2e needs a CUDA device")
    if not Path(args.gguf_path).exists():
        p.error(f"--gguf_path {args.gguf_path} does not exist")
    report = measure(args)
    if args.json:
        print_json(report)
    else:
        print_table(report)


@dataclass
class Report:
    """One run: our measurements (and llama.cpp's), a decode step's bytes and the rates the
    rooflines are computed at."""

    args: argparse.Namespace
    config: object
    model: object
    ours: dict
    probes: list[float]  # the stream probes around each timed decode (GB/s)
    cpu_bytes: float  # a decode step's bytes from RAM and from GPU memory, hot experts counted
    gpu_bytes: float
    all_cpu: tuple[float, float]  # the same with every expert in RAM (llama.cpp's -ot exps=CPU)
    hot: dict[int, int]
    gpu_bw: float
    shares: dict[int, int] = field(default_factory=dict)
    bus_bw: float | None = None
    roof_bus: float | None = None
    extra: dict | None = None
    peer: dict | None = None
    path: str | None = None

    @property
    def cpu_bw(self) -> float:
        # The RAM's rate for the roofline: the mean of the stream probes taken right before and
        # right after each timed decode (the host's memory bandwidth drifts within a run, so one
        # probe can be far off)
        return statistics.mean(self.probes)

    def roofline(self, ram: float, gpu: float, ram_gbps: float | None = None) -> float:
        return 1 / (ram / ((ram_gbps or self.cpu_bw) * 1e9) + gpu / (self.gpu_bw * 1e9))

    @property
    def roof(self) -> float:
        return self.roofline(self.cpu_bytes, self.gpu_bytes)

    @property
    def roof_all_cpu(self) -> float:
        return self.roofline(*self.all_cpu)

    @property
    def rows(self) -> list[dict]:
        return [dict(engine="ktransformers", **self.ours)] + ([dict(engine="llama.cpp", **self.peer)]
                                                              if self.peer else [])

    def roof_of(self, row: dict) -> float:
        """The roofline a row is compared with: llama.cpp's keeps every expert in RAM."""
        return self.roof if row["engine"] == "ktransformers" else self.roof_all_cpu


def measure(args) -> Report:
    from ..loader import load_config
    from ..weights.gguf import GGUFFileSet
    from .decode import step_bytes
    files = GGUFFileSet(args.gguf_path)
    config = load_config(args.model_path, args.gguf_path, files)
    all_cpu = step_bytes(files, config)  # experts from RAM, the rest from the GPU (llama.cpp's -ot exps=CPU)
    ours = measure_ours(args, config)
    model = ours.pop("loaded").model
    hot = hot_experts_per_layer(model)
    cpu_bytes, gpu_bytes = hot_split(files, config, hot) if hot else all_cpu
    probes = ours.pop("probes")
    r = Report(args=args, config=config, model=model, ours=ours, probes=probes, cpu_bytes=cpu_bytes,
               gpu_bytes=gpu_bytes, all_cpu=all_cpu, hot=hot, gpu_bw=gpu_copy_gbps())
    r.shares = pcie_shares(model)
    if r.shares:
        # The GPU reads a share of the experts over the bus while the cores read the rest: the
        # expert bytes' floor is then at the two rates together (an upper bound of what they
        # reach together: they share the host's memory)
        from ..kernels.triton.pcie_experts import bus_read_gbps
        r.bus_bw = bus_read_gbps(torch.device("cuda"))
        r.roof_bus = r.roofline(cpu_bytes, gpu_bytes, r.cpu_bw + r.bus_bw)
    if args.extrapolate:
        roof_n = r.roofline(*extrapolated_bytes(files, config, args.extrapolate, hot))
        r.extra = {"layers": args.extrapolate, "roofline_tok_s": roof_n, "decode": ours["decode"] / r.roof * roof_n}
    r.peer = measure_llama(args)
    r.path = layerwise_path(model)
    return r


def print_json(r: Report) -> None:
    """One JSON line per engine."""
    args = r.args
    for row in r.rows:
        ours = row["engine"] == "ktransformers"
        print(json.dumps({**row, "roofline_tok_s": r.roof_of(row),
                          "cpu_gbps": r.cpu_bw, "cpu_probes_gbps": r.probes, "gpu_gbps": r.gpu_bw,
                          "hot_experts": r.hot, "pcie_experts": r.shares, "layerwise": r.path,
                          "bus_gbps": r.bus_bw, "roofline_with_bus_tok_s": r.roof_bus,
                          "pcie_auto_rates": r.model.kt_context.pcie_rates,
                          "layers": r.config.num_hidden_layers, "threads": args.threads,
                          "step_ms": 1e3 / row["decode"] if row["decode"] else None,
                          "cpu_call_us": row.get("cpu_call_us"), "between_us": row.get("between_us"),
                          "issue_us": row.get("issue_us"),
                          "rest_of_step_us": (1e6 / row["decode"] - row["layers_us"]
                                              if row.get("layers_us") and row["decode"] else None),
                          "extrapolated": r.extra if ours else None,
                          "temperature": args.temperature if ours else 0.0,
                          "top_p": args.top_p if ours and args.temperature else 1.0}))


def print_table(r: Report) -> None:
    print(header(r))
    prompts = r.args.prompts
    cols = "".join(f" {'prefill@' + str(P):>13}" for P in prompts)
    print(f"{'engine':<14}{cols} {'decode tok/s':>13} {'of roofline':>12}")
    for row in r.rows:
        pre = "".join(f" {row['prefill'].get(P, float('nan')):>13.1f}" for P in prompts)
        dec = row["decode"] or float("nan")
        bus = f" ({dec / r.roof_bus:.2f} with the bus)" if r.roof_bus and row["engine"] == "ktransformers" else ""
        print(f"{row['engine']:<14}{pre} {dec:>13.1f} {dec / r.roof_of(row):>12.2f}{bus}")
    print_step_split(r)
    if r.extra:
        print(f"extrapolated to {r.extra['layers']} layers (same fraction of its roofline, "
              f"{r.extra['roofline_tok_s']:.1f} tok/s): decode {r.extra['decode']:.1f} tok/s")
    if r.peer:
        ours, peer = r.ours, r.peer
        print("ours / llama.cpp: " + ", ".join(f"prefill@{P} {ours['prefill'][P] / peer['prefill'][P]:.2f}x"
                                                for P in prompts if peer['prefill'].get(P))
              + (f", decode {ours['decode'] / peer['decode']:.2f}x" if peer["decode"] else ""))


def header(r: Report) -> str:
    """The table's first line: the model, the step's bytes and rates, the rooflines, the options."""
    args, config, hot, kt = r.args, r.config, r.hot, r.model.kt_context
    head = (f"{Path(args.gguf_path).name}: {config.model_type}, {config.num_hidden_layers} layers, "
            f"{args.threads} threads; "
            f"decode reads {r.cpu_bytes / 1e6:.0f} MB from RAM ({r.cpu_bw:.0f} GB/s: the mean of the probes "
            f"{', '.join(f'{b:.0f}' for b in r.probes)} around the decode) + {r.gpu_bytes / 1e6:.0f} MB from the GPU "
            f"({r.gpu_bw:.0f} GB/s): roofline {r.roof:.1f} tok/s")
    if hot:
        head += (f" (hot experts on the GPU: {min(hot.values())}-{max(hot.values())} a layer in {len(hot)} layers; "
                 f"llama.cpp's row is against the roofline with every expert in RAM, {r.roof_all_cpu:.1f} tok/s)")
    if r.roof_bus:
        head += (f"; pcie_experts {min(r.shares.values())}-{max(r.shares.values())} of {config.num_experts_per_tok}: "
                 f"the GPU reads its share over the bus "
                 f"({r.bus_bw:.0f} GB/s alone), roofline with the bus {r.roof_bus:.1f} tok/s")
        if kt.pcie_rates:  # (what "auto" chose from, measured at load)
            head += f" (auto chose at bus {kt.pcie_rates[0]:.0f}, CPU {kt.pcie_rates[1]:.0f} GB/s)"
    if r.path:
        threshold = args.prefill_gpu_threshold
        where = "the rule file's threshold" if threshold is None else f"{threshold} tokens"
        head += f"; layer-wise prefill ({r.path}) from {where}"
    if args.temperature:
        head += f"; our decode samples (temperature {args.temperature}, top_p {args.top_p})"
    return head


def print_step_split(r: Report) -> None:
    """Where a decode step's time goes, from the doorbell's counters."""
    ours = r.ours
    step_ms = 1e3 / ours["decode"]
    print(f"decode step {step_ms:.2f} ms = {step_ms / r.config.num_hidden_layers:.3f} ms per layer")
    if "cpu_call_us" not in ours:
        return
    print(f"  of a layer: {ours['cpu_call_us']:.1f} us in the CPU experts (the doorbell's calls), "
          f"{ours['between_us']:.1f} us from a call's end to the next layer's ring (GPU part and hand-offs)")
    print(f"  the rest of a step: {step_ms * 1e3 - ours['layers_us']:.0f} us (the GPU work before the first "
          f"MoE layer's call and after the last, the step's sync and Python, and any gap between layers "
          f"longer than the doorbell's spin); of it {ours['issue_us']:.0f} us issuing the step on the host "
          f"(cache bookkeeping, graph inputs, the replay's launch)")


if __name__ == "__main__":
    main()
