"""Layer-wise prefill from the CPU's tiles, timed by the cap on the dequantizing kernel's programs
(KT_TILES_PROGRAMS, read at every launch). One model load; the caps take turns within every round
(the first round a warm-up), so that the host's drift falls on all of them alike.
    python dev/gpu_tiles_programs.py FILE.gguf [CAPS [PROMPTS [ROUNDS]]]
CAPS: comma-separated, 0 = one program a run of four tiles (default "0,264,528,1056"); PROMPTS:
comma-separated prompt lengths (default "2048,8192"); ROUNDS: timed rounds (default 3).
THREADS: CPU threads (default 14)."""
import os
import statistics
import sys
import time

import torch


def main() -> None:
    from ktransformers.bench.e2e import layerwise_path, sync
    from ktransformers.engine.generate import Engine
    from ktransformers.loader import freeze_heap, load_model
    path = sys.argv[1]
    caps = (sys.argv[2] if len(sys.argv) > 2 else "0,264,528,1056").split(",")
    prompts = [int(p) for p in (sys.argv[3] if len(sys.argv) > 3 else "2048,8192").split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    loaded = load_model(path, None, None, progress=False, cpu_infer=int(os.environ.get("THREADS", "14")),
                        tokenizer=False, default_device="cuda")
    freeze_heap()
    print(f"layer-wise path: {layerwise_path(loaded.model)}", flush=True)
    engine = Engine(loaded.model, None, cache_lens=max(prompts) + 256, page_size=256, chunk_size=max(prompts),
                    use_cuda_graph=True, max_batch=1)
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rates = {(c, p): [] for c in caps for p in prompts}
    for r in range(rounds + 1):
        for cap in caps:
            os.environ["KT_TILES_PROGRAMS"] = cap
            for p in prompts:
                seq = engine.new_sequence()
                prompt = torch.randint(3, vocab, (p,), generator=gen).tolist()
                sync()
                t0 = time.perf_counter()
                engine.prefill(seq, prompt)
                sync()
                if r:
                    rates[(cap, p)].append(p / (time.perf_counter() - t0))
                engine.release(seq)
    print(f"{'programs':>8} {'prompt':>6} {'median tok/s':>12} {'min':>9} {'max':>9} {'vs 0':>5}")
    for p in prompts:
        base = statistics.median(rates[(caps[0], p)])
        for cap in caps:
            v = rates[(cap, p)]
            print(f"{cap:>8} {p:>6} {statistics.median(v):>12.1f} {min(v):>9.1f} {max(v):>9.1f} "
                  f"{statistics.median(v) / base:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
