"""CPU experts run from a GPU stream: the extension's host functions (checked here by calling
them as the stream would), and on CUDA, hybrid experts through pinned staging and CUDA-graph
decode steps equal to eager ones."""
import ctypes
import os
import time

import pytest
import torch
from test_models import mxfp4_moe, q4_k_m
from tiny import gpu_rules, tiny_model, wait_all, with_experts_kwargs

from ktransformers import optimize_and_load_gguf
from ktransformers.engine.generate import Engine
from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, MoEKernel
from ktransformers.kernels.cuda_host import HostStaging, call_host_func
from ktransformers.loader import build_skeleton
from ktransformers.operators.experts import KExpertsCPU
from ktransformers.weights.ggml_quants import GGMLType, random_blocks
from ktransformers.weights.gguf_write import write_gguf


def _kernel(runtime, E=6, K=2, H=256, I=256):
    g = torch.Generator().manual_seed(0)
    w = [ExpertWeights(random_blocks(GGMLType.Q8_0, E * r * c // 32, g).reshape(-1), int(GGMLType.Q8_0))
         for r, c in ((I, H), (I, H), (H, I))]
    return MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=w[0], up=w[1], down=w[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_functions_run_the_moe_call(dtype):
    runtime = CPURuntime(2)
    kernel = _kernel(runtime)
    staging = HostStaging(runtime, pinned=False)
    g = torch.Generator().manual_seed(1)
    for T in (1, 5, 3):  # calls of several sizes share (and grow) the staging buffer
        x, ids, w, y, call = staging.prepare(kernel, T, dtype)
        x.copy_(torch.randn(T, 256, generator=g))
        ids.copy_(torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(T)]))
        w.copy_(torch.rand(T, 2, generator=g))
        call_host_func(runtime.ext.moe_host_submit, call.address)
        call_host_func(runtime.ext.moe_host_wait, call.address)
        assert call.take_error() == ""
        assert torch.equal(y, kernel.forward(x.clone(), ids.clone(), w.clone()))
    ids[0, 0] = 6  # a bad id: recorded, not a crash; raised by whoever checks after the stream
    call_host_func(runtime.ext.moe_host_submit, call.address)
    call_host_func(runtime.ext.moe_host_wait, call.address)
    staging.used.append((call, "layer 3 experts"))
    with pytest.raises(ValueError, match=r"layer 3 experts: MoE: expert id 6 .* outside \[0, 6\)"):
        staging.check_errors()


def _word(address: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(address)


def _ring_and_wait(staging, kernel, T, dtype, number=None, timeout=60.0):
    """Do what the GPU stream does in doorbell mode: ring, wait for done, clear it."""
    ring, done = staging.flags(kernel)
    _word(ring).value = staging.number(kernel, T, dtype) if number is None else number
    staging.wake()
    deadline = time.monotonic() + timeout
    while _word(done).value != 1:
        assert time.monotonic() < deadline, "the doorbell never set done"
        time.sleep(1e-4)
    assert _word(ring).value == 0  # cleared by the doorbell before it set done
    _word(done).value = 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doorbell_runs_the_rung_call(dtype):
    """The doorbell thread serves a ring as the stream would see it: y written before done, for
    calls of several sizes on one layer's words; a bad id and a number naming no call are
    recorded, and done is still set (the GPU never hangs)."""
    runtime = CPURuntime(2)
    kernels = [_kernel(runtime), _kernel(runtime, E=5)]
    staging = HostStaging(runtime, pinned=False)
    g = torch.Generator().manual_seed(2)
    served = 0
    for T in (1, 5, 3, 1):
        for kernel in kernels:
            x, ids, w, y, call = staging.prepare(kernel, T, dtype)
            x.copy_(torch.randn(T, 256, generator=g))
            ids.copy_(torch.stack([torch.randperm(kernel.experts, generator=g)[:2] for _ in range(T)]))
            w.copy_(torch.rand(T, 2, generator=g))
            y.fill_(float("nan"))
            _ring_and_wait(staging, kernel, T, dtype)
            served += 1
            assert staging.doorbell.served == served
            assert call.take_error() == ""
            assert torch.equal(y, kernel.forward(x.clone(), ids.clone(), w.clone()))
    ids[0, 0] = 7
    _ring_and_wait(staging, kernels[1], 1, dtype)
    staging.used.append((call, "layer 4 experts"))
    with pytest.raises(ValueError, match=r"layer 4 experts: MoE: expert id 7 .* outside \[0, 5\)"):
        staging.check_errors()
    _ring_and_wait(staging, kernels[0], 1, dtype, number=10_000)
    assert staging.doorbell.bad_rings == 1
    with pytest.raises(RuntimeError, match="number that names no call"):
        staging.check_errors()
    staging.check_errors()  # (said once)
    assert len({staging.flags(k) for k in kernels}) == 2  # a pair of words per layer, kept


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _thread_counters(tid: int) -> tuple[int, int]:
    """(nanoseconds the thread has run, its voluntary context switches): a spinning thread's first
    grows while its second stands still; a sleeping one's first stands still; a napping one adds
    a switch per nap. Counters, not wall time: a loaded machine only delays them."""
    ran = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
    with open(f"/proc/self/task/{tid}/status") as f:
        switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return ran, switches


def _sample_until(tids, done, what: str, timeout: float = 60.0, window: float = 0.01, before=lambda: None) -> dict:
    """Sample the threads' counters over short windows until `done(deltas)` holds for one (then
    return those deltas), or fail after `timeout`: a hang guard. A loaded machine needs more
    windows; what is asserted stays a count of nanoseconds run and of switches."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before()
        a = {t: _thread_counters(t) for t in tids}
        time.sleep(window)
        b = {t: _thread_counters(t) for t in tids}
        deltas = {t: (b[t][0] - a[t][0], b[t][1] - a[t][1]) for t in tids}
        if done(deltas):
            return deltas
    pytest.fail(f"{what} within {timeout:.0f} s")


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
                    reason="reads the threads' counters from Linux's /proc/self/task/*/schedstat")
def test_doorbell_rest_and_wake(monkeypatch):
    """wake() makes the doorbell thread spin (it runs without blocking); rest() stops it and the
    pool's worker spinning at once (the doorbell then naps, the worker sleeps), the later of a
    wake() and a rest() wins, and a call rung while resting, or right after a wake, is still
    served and right. Spin windows of seconds make a rest() that did not stop them show as
    seconds of a thread's CPU time, where a working one costs microseconds."""
    monkeypatch.setattr(HostStaging, "DOORBELL_SPIN_US", 2_000_000)
    before = _threads()
    runtime = CPURuntime(2, spin_us=500_000)
    pool = _threads() - before  # the pool's worker and the runtime's dispatcher
    kernel = _kernel(runtime)
    staging = HostStaging(runtime, pinned=False)
    staging.prepare(kernel, 2, torch.float32)
    before = _threads()
    staging.flags(kernel)  # (starts the doorbell thread)
    doorbell = _threads() - before
    assert pool and len(doorbell) == 1, (pool, doorbell)
    (bell,) = doorbell
    g = torch.Generator().manual_seed(5)

    def one_call(ring):
        x, ids, w, y, call = staging.prepare(kernel, 2, torch.float32)
        x.copy_(torch.randn(2, 256, generator=g))
        ids.copy_(torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(2)]))
        w.copy_(torch.rand(2, 2, generator=g))
        y.fill_(float("nan"))
        ring()
        assert torch.equal(y, kernel.forward(x.clone(), ids.clone(), w.clone()))

    one_call(lambda: _ring_and_wait(staging, kernel, 2, torch.float32))
    staging.rest()
    # a nap costs the doorbell about ten microseconds: half a millisecond run without one is a spin
    _sample_until(doorbell, lambda d: d[bell][0] >= 500_000 and d[bell][1] == 0,
                  "the doorbell never spun after wake()", before=staging.wake)
    staging.wake()
    staging.rest()  # (the later of the two wins)
    ran = {t: 0 for t in doorbell | pool}

    def napped_twice(d):  # what every thread ran until the doorbell has blocked twice since rest()
        for t in ran:
            ran[t] += d[t][0]
        return d[bell][1] >= 2
    _sample_until(doorbell | pool, napped_twice, "the doorbell never napped after rest()", window=0.001)
    assert all(n < 50_000_000 for n in ran.values()), f"nanoseconds run after rest() (spinning?): {ran}"
    _sample_until(doorbell | pool, lambda d: d[bell][1] >= 2 and all(d[t][0] == 0 for t in pool),
                  "the pool's threads never slept while the doorbell napped")

    def ring_resting():  # no wake(): served within the idle nap
        ring, done = staging.flags(kernel)
        _word(ring).value = staging.number(kernel, 2, torch.float32)
        deadline = time.monotonic() + 60  # (a hang guard)
        while _word(done).value != 1:
            assert time.monotonic() < deadline, "a call rung while resting was never served"
            time.sleep(1e-4)
        _word(done).value = 0
    for _ in range(5):
        staging.rest()
        one_call(ring_resting)
        staging.rest()
        one_call(lambda: _ring_and_wait(staging, kernel, 2, torch.float32))
    staging.rest()
    staging.check_errors()


def test_doorbell_and_python_calls_share_the_pool():
    """The doorbell thread and Python both drive the one pool (a GPU step's CPU experts while
    Python runs a CPU kernel, e.g. a bandwidth probe or a CPU-placed layer): they take turns,
    every result is right and nothing deadlocks."""
    import threading
    runtime = CPURuntime(2)
    kernel = _kernel(runtime)
    staging = HostStaging(runtime, pinned=False)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 256, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(3)])
    w = torch.rand(3, 2, generator=g)
    expected = kernel.forward(x, ids, w)
    bad: list = []

    def python_side():
        for _ in range(40):
            if not torch.equal(kernel.forward(x, ids, w), expected):
                bad.append("python")
    other = threading.Thread(target=python_side)
    other.start()
    xp, idp, wp, yp, _ = staging.prepare(kernel, 3, torch.float32)
    for _ in range(40):
        xp.copy_(x), idp.copy_(ids), wp.copy_(w), yp.fill_(float("nan"))
        _ring_and_wait(staging, kernel, 3, torch.float32)
        if not torch.equal(yp, expected):
            bad.append("doorbell")
    other.join(timeout=60)
    assert not other.is_alive() and not bad


def test_host_function_addresses_are_c_functions():
    ext = CPURuntime(1).ext
    assert isinstance(ext.moe_host_submit, int) and ext.moe_host_submit != ext.moe_host_wait
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ext.moe_host_wait)  # a callable address


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_cuda_graph_decode_equals_eager(tmp_path, family):
    """Graph replays (CPU experts as host functions inside the graph, hot experts on the GPU)
    give the eager step's logits, for one sequence and for two in one batch, as sequences come,
    go, swap places in the batch and cross page boundaries."""
    hf = tiny_model(family, layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    model = build_skeleton(hf.config, torch.bfloat16)
    optimize_and_load_gguf(model, gpu_rules(family, tmp_path, "cuda", "num_gpu_experts: 2"), tmp_path / "m.gguf",
                           hf.config)
    ids = torch.randint(0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(8)).tolist()
    results = []
    for graphs in (False, True):
        engine = Engine(model, cache_lens=128, page_size=16, chunk_size=8, use_cuda_graph=graphs, max_batch=4)
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.prefill(a, ids[:10])
        engine.prefill(b, ids[3:7])
        out = [engine.decode(a, t)[0] for t in ids[10:16]]
        out += list(engine.step([a, b], [[ids[16]], [ids[7]]]))
        out += list(engine.step([a, b], [[ids[17]], [ids[8]]]))
        # the graph's slot-table rows change hands: sequences swap rows, one is freed and its
        # pages go to a new one, a row's sequence crosses a page boundary
        out += list(engine.step([b, a], [[ids[9]], [ids[18]]]))
        engine.release(b)
        c = engine.new_sequence()
        engine.prefill(c, ids[5:20])
        for t in range(3):
            out += list(engine.step([c, a], [[ids[20 + t]], [ids[t]]]))
        results.append(torch.stack(out).float().cpu())
        if graphs:
            assert engine.graphs.batch_sizes == [1, 2]
    err = ((results[0] - results[1]).norm() / results[0].norm()).item()
    assert err < 1e-2, f"graph vs eager {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scheduler_runs_batches_ahead_with_the_answers_of_generate(tmp_path):
    """The server's scheduler on one GPU keeps a batched graph step in flight (decodes_ahead):
    greedy and seeded answers of requests of different lengths, one ending on a stop token mid-way,
    equal Engine.generate's one by one. In float32: in bf16 a batch of 4 and a batch of 1 round
    the GPU's products differently, and the tiny model's near-ties then pick other tokens. A seeded
    request's every draw, the first one after its prompt too, is made on the GPU, as generate's."""
    from ktransformers.engine.sampling import SamplingParams
    from ktransformers.server.scheduler import Request, Scheduler
    from tiny import train_tokenizer
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    hf.config.eos_token_id = None  # (answers of the full length: no EOS to stop either side early)
    model = build_skeleton(hf.config, torch.float32)
    optimize_and_load_gguf(model, gpu_rules("qwen3_moe", tmp_path, "cuda"), tmp_path / "m.gguf", hf.config)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
    tokenizer = train_tokenizer(hf.config.vocab_size)
    tokenizer.eos_token = None
    engine = Engine(model, tokenizer, cache_lens=512, page_size=16, chunk_size=32, use_cuda_graph=True, max_batch=4)
    assert engine.decodes_ahead()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    params = [SamplingParams(do_sample=False) if i % 2 == 0 else SamplingParams(temperature=0.8, seed=i)
              for i in range(4)]
    expected = [list(engine.generate(p, q, 20).token_ids()) for p, q in zip(prompts, params)]
    stop = next(t for k, t in enumerate(expected[0]) if k >= 4 and t not in expected[0][:k])
    sched = Scheduler(engine, tokenizer, max_batch=4, prefix_cache=False)
    assert sched.run_ahead and not sched.eos_ids
    try:
        reqs = [Request(p, q, 20) for p, q in zip(prompts, params)]
        reqs[0].stop_ids = frozenset({stop})
        for r in reqs:
            sched.submit(r)
        wait_all(reqs, 120)
    finally:
        sched.close()
    assert reqs[0].tokens == expected[0][:expected[0].index(stop) + 1]
    assert [r.tokens for r in reqs[1:]] == expected[1:]
    assert sched.stats.decode_steps > 0 and len(engine.cache._free) == engine.cache.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_captures_every_batch_size_and_changes_no_answer(tmp_path):
    """Engine.warm_up captures the decode graph of each batch size asked for and gives every
    cache page back; the greedy answers after it are those of an engine that did not warm up."""
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    model = build_skeleton(hf.config, torch.bfloat16)
    optimize_and_load_gguf(model, gpu_rules("qwen3_moe", tmp_path, "cuda"), tmp_path / "m.gguf", hf.config)
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    answers = []
    for warm in (False, True):
        engine = Engine(model, cache_lens=256, page_size=16, chunk_size=32, use_cuda_graph=True, max_batch=4)
        if warm:
            assert engine.warm_up(batch_sizes=range(1, 5), progress=False) > 0
            assert engine.graphs.batch_sizes == [1, 2, 3, 4]
            assert len(engine.cache._free) == engine.cache.num_pages
        answers.append([list(engine.generate(ids[:n], max_new_tokens=6).token_ids()) for n in (5, 20)])
    assert answers[0] == answers[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_doorbell_equals_host_functions(tmp_path, monkeypatch, family):
    """The two hand-offs of CPU experts fed from a GPU stream (kernels/cuda_host.py), with their
    inputs copied or packed by one kernel into pinned memory, or stored by the router's launch
    and y read back by the launch that also adds and normalizes for the next layer
    (HostStaging's fuse), give the same logits, eagerly and replayed from CUDA graphs; the doorbell,
    the pack and the fused launches are what the stream used."""
    from ktransformers.kernels.triton import handoff
    hf = tiny_model(family, layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(10)).tolist()
    results = {}
    spied = {"pack": [], "back": []}
    real_pack, real_back = handoff.pack_moe_inputs, handoff.copy_rows_add_norm
    monkeypatch.setattr(handoff, "pack_moe_inputs", lambda x, *a, **k: spied["pack"].append(x.shape[0]) or real_pack(x, *a, **k))
    monkeypatch.setattr(handoff, "copy_rows_add_norm", lambda y, *a, **k: spied["back"].append(y.shape[0]) or real_back(y, *a, **k))
    for mode, pack, fuse in (("host", "0", "0"), ("doorbell", "0", "0"), ("doorbell", "1", "0"), ("doorbell", "1", "1")):
        model = build_skeleton(hf.config, torch.bfloat16)
        optimize_and_load_gguf(model, gpu_rules(family, tmp_path, "cuda"), tmp_path / "m.gguf", hf.config)
        _use_staging(model, mode, pack == "1", fuse == "1")
        for graphs in (False, True):
            engine = Engine(model, cache_lens=64, page_size=16, chunk_size=8, use_cuda_graph=graphs)
            seq = engine.new_sequence()
            for calls in spied.values():
                calls.clear()
            out = [engine.prefill(seq, ids[:9])[0]]  # (chunks of 8 and 1 tokens)
            prefilled = {name: len(calls) for name, calls in spied.items()}
            out += [engine.decode(seq, t)[0] for t in ids[9:]]
            results[mode, pack + fuse, graphs] = torch.stack(out).float().cpu()
            if not graphs:  # (eager: every step's launches made from Python, so spied on)
                decode_packs = spied["pack"][prefilled["pack"]:].count(1)
                if fuse == "1" and family == "qwen3_moe":  # the softmax router packs; layer 0 adds + norms
                    assert decode_packs == 0 and spied["back"][prefilled["back"]:] == [1] * (len(ids) - 9)
                else:
                    assert (decode_packs > 0) == (pack == "1") and not spied["back"]
        staging = engine.context._staging
        assert set(staging.mode.values()) == {mode}
        assert set(staging._packs.values()) == {pack == "1"} and staging.fuse == (fuse == "1")
        assert (staging.doorbell is not None) == (mode == "doorbell")
        if mode == "doorbell":
            assert staging.doorbell.served >= len(ids) and staging.doorbell.bad_rings == 0
            assert staging.doorbell.busy_ns > 0
            assert staging.doorbell.betweens > 0 or family == "deepseek_v3"  # (its tiny model: one MoE layer)
    for graphs in (False, True):
        for other in (("doorbell", "00"), ("doorbell", "10"), ("doorbell", "11")):
            assert torch.equal(results["host", "00", graphs], results[(*other, graphs)]), (other, graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", ["", "num_gpu_experts: 3"])
def test_pcie_experts_decode_equals_cpu_experts(tmp_path, extra):
    """Decode with pcie_experts: 1 (the GPU computes one of each token's two experts from the CPU
    kernel's tiles, read over the bus, the CPU the other) gives the all-CPU logits, eagerly and
    from CUDA graphs (and in prefill chunks of up to 8 tokens); beside hot experts the share is
    off (warned) and the logits are the all-CPU ones to the bit."""
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(13)).tolist()
    results = {}
    for share in ("0", "1"):
        rules = gpu_rules("qwen3_moe", tmp_path, "cuda", extra)
        model = build_skeleton(hf.config, torch.bfloat16)
        optimize_and_load_gguf(model, with_experts_kwargs(rules, tmp_path, pcie_experts=int(share)),
                               tmp_path / "m.gguf", hf.config)
        ops = [op for m in model.modules() if isinstance(op := getattr(m, "ops", {}).get("generate"), KExpertsCPU)]
        assert ops and all((op.pcie is not None) == (share == "1" and not extra) for op in ops)
        for graphs in (False, True):
            engine = Engine(model, cache_lens=64, page_size=16, chunk_size=8, use_cuda_graph=graphs)
            seq = engine.new_sequence()
            out = [engine.prefill(seq, ids[:9])[0]] + [engine.decode(seq, t)[0] for t in ids[9:]]
            results[share, graphs] = torch.stack(out).float().cpu()
        for op in ops:
            op.unload()
    for graphs in (False, True):
        a, b = results["0", graphs], results["1", graphs]
        if extra:
            assert torch.equal(a, b)
            continue
        err = ((a - b).norm() / a.norm()).item()
        assert err < 2e-2, f"pcie share vs CPU, graphs={graphs}: {err:.2e}"
        assert not torch.equal(a, b)  # (the share did run: other roundings)


def _use_staging(model, handoff: str, pack: bool, fuse: bool = True) -> None:
    """The model's CPU experts fed from the GPU through HostStaging(handoff=, pack=, fuse=) (the
    engine's default is the doorbell, packed and fused)."""
    ctx = model.kt_context
    ctx._staging = HostStaging(ctx.cpu_runtime(), pinned=True, handoff=handoff, pack=pack, fuse=fuse)


def _gpu_qwen3(tmp_path, layers: int = 2):
    """A tiny random Qwen3-MoE (transformers' model, Q4_K_M in a GGUF) loaded by its GPU rule
    file: (the transformers model, ours)."""
    hf = tiny_model("qwen3_moe", layers=layers)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    model = build_skeleton(hf.config, torch.bfloat16)
    optimize_and_load_gguf(model, gpu_rules("qwen3_moe", tmp_path, "cuda"), tmp_path / "m.gguf", hf.config)
    return hf, model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("handoff,pack", [("doorbell", "1"), ("doorbell", "0"), ("host", "0")])
def test_greedy_decode_ahead_equals_step_by_step(tmp_path, monkeypatch, handoff, pack):
    """Greedy tokens decoded one step ahead (each graph step issued on the previous step's argmax
    still on the GPU, the CPU experts started by it), for each hand-off, are the step-by-step
    tokens; stopping early drops the step issued ahead from the cache, and decoding then goes on
    the same; greedy generation takes the same path."""
    from ktransformers.engine.sampling import SamplingParams
    hf, model = _gpu_qwen3(tmp_path)
    _use_staging(model, handoff, pack == "1")
    prompt = torch.randint(0, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(12)).tolist()
    runs, decodes_ahead = {}, Engine.decodes_ahead
    for ahead in ("0", "1"):
        # (step by step: as where the decode graph is split in segments)
        monkeypatch.setattr(Engine, "decodes_ahead", decodes_ahead if ahead == "1" else lambda self: False)
        engine = Engine(model, cache_lens=128, page_size=16, chunk_size=8, use_cuda_graph=True)
        assert engine.graphs is not None and engine.decodes_ahead() == (ahead == "1")
        seq = engine.new_sequence()
        first = int(engine.prefill(seq, prompt)[0].argmax())
        it = engine.greedy_tokens(seq, first, 40)
        got = [next(it) for _ in range(20)]  # (across a page boundary: 11 + 20 > 16)
        it.close()
        length, cached = seq.length, list(engine.cached_tokens(seq))
        more = list(engine.greedy_tokens(seq, got[-1], 5))
        engine.release(seq)
        gen = engine.generate(prompt, SamplingParams(do_sample=False), 12)
        list(gen)
        runs[ahead] = (got, length, cached, more, gen.tokens, gen.finish_reason)
        staging = engine.context._staging
        assert set(staging.mode.values()) == {handoff}
        assert (staging.doorbell is not None) == (handoff == "doorbell")
        staging.check_errors()
    assert runs["0"] == runs["1"]
    got, length, cached = runs["1"][:3]
    assert length == len(prompt) + 20 and cached == prompt + [first] + got[:19]
    assert runs["1"][4][:1] == [first] and runs["1"][5] == "length"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_decode_ahead_equals_step_by_step(tmp_path, monkeypatch):
    """Sampled tokens decoded one step ahead (each step's draw made on the GPU and fed to the
    next step there) are the step-by-step tokens for the same seed, in decode_tokens and in
    sampled generation; logits with nothing to draw from fail the step and drop it."""
    from ktransformers.engine.sampling import Sampler, SamplingParams
    hf, model = _gpu_qwen3(tmp_path)
    prompt = torch.randint(0, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(13)).tolist()
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=7)  # (hot: a tiny random model's draws vary)
    runs, decodes_ahead = {}, Engine.decodes_ahead
    for ahead in ("0", "1"):
        # (step by step: as where the decode graph is split in segments)
        monkeypatch.setattr(Engine, "decodes_ahead", decodes_ahead if ahead == "1" else lambda self: False)
        engine = Engine(model, cache_lens=128, page_size=16, chunk_size=8, use_cuda_graph=True)
        assert engine.decodes_ahead() == (ahead == "1")
        seq = engine.new_sequence()
        sampler = Sampler(params)
        first = int(sampler(engine.prefill(seq, prompt))[0])
        it = engine.decode_tokens(seq, first, 40, sampler)
        got = [next(it) for _ in range(20)]
        it.close()
        length, cached = seq.length, list(engine.cached_tokens(seq))
        more = list(engine.decode_tokens(seq, got[-1], 5, Sampler(params)))
        gen = engine.generate(prompt, params, 12)
        list(gen)
        runs[ahead] = (got, length, cached, more, gen.tokens, gen.finish_reason)
        if ahead == "1":
            bad = Sampler(params)
            real_pick = bad.pick
            monkeypatch.setattr(bad, "pick", lambda logits, prev=None: (real_pick(logits)[0],
                                                                       torch.zeros(1, dtype=torch.bool, device=logits.device)))
            before = seq.length
            with pytest.raises(ValueError, match="nothing to sample"):
                list(engine.decode_tokens(seq, more[-1], 5, bad))
            assert seq.length == before and len(engine.cached_tokens(seq)) == before
        engine.release(seq)
        engine.context._staging.check_errors()
    assert runs["0"] == runs["1"]
    got, length, cached = runs["1"][:3]
    assert length == len(prompt) + 20 and cached == prompt + [first] + got[:19]
    assert len(set(got)) > 3  # it samples (a greedy decode of a tiny model repeats itself)
    with pytest.raises(ValueError, match="repetition penalty"):
        next(engine.decode_tokens(engine.new_sequence(), first, 3, Sampler(SamplingParams(repetition_penalty=1.2))))


def _prefill_on_cpu_and_gpu(engine, ids) -> list[torch.Tensor]:
    """The prompt's logits with the experts on the CPU (threshold 0: layer-wise prefill off) and
    layer by layer on the GPU (threshold 8), asserted to agree; both returned."""
    results = []
    for threshold in (0, 8):
        engine.context.prefill_gpu_threshold = threshold
        seq = engine.new_sequence()
        results.append(engine.prefill(seq, ids).float().cpu())
        engine.release(seq)
    err = ((results[0] - results[1]).norm() / results[0].norm()).item()
    assert err < 3e-2, f"layer-wise prefill vs CPU experts {err:.2e}"
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layerwise_prefill_of_gpt_oss_mxfp4_experts(tmp_path):
    """gpt-oss's MXFP4 experts (biases, clamped SwiGLU) prefilled layer by layer on the GPU: the
    CPU experts' logits, and the sinks attention's on the Triton kernels."""
    hf = tiny_model("gpt_oss", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=mxfp4_moe)
    model = build_skeleton(hf.config, torch.bfloat16)
    optimize_and_load_gguf(model, gpu_rules("gpt_oss", tmp_path, "cuda"), tmp_path / "m.gguf", hf.config)
    layers = [m for m in model.modules() if getattr(m, "layerwise", None) is not None]
    assert len(layers) == 2 and all(m.layerwise.bias is not None for m in layers)
    engine = Engine(model, cache_lens=128, page_size=16, chunk_size=64)
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    _prefill_on_cpu_and_gpu(engine, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["tiles", "staged"])
def test_layerwise_prefill_equals_cpu_experts(tmp_path, monkeypatch, path):
    """Prefill chunks above prefill_gpu_threshold stream each layer's experts to the GPU (next
    layer prefetched) and give what the CPU experts give: read in place from the CPU kernel's
    tiles, or (staged) the GGUF's bytes through pinned chunks, made small and of a size no GGML
    block divides, so every tensor crosses several chunks at odd offsets."""
    from ktransformers.operators.experts import LayerwisePrefill, expert_groups
    monkeypatch.setattr(LayerwisePrefill, "CHUNK", 1000)
    if path == "staged":
        monkeypatch.setattr(LayerwisePrefill, "_tiles", lambda self, cpu_op: None)
    hf, model = _gpu_qwen3(tmp_path, layers=3)
    engine = Engine(model, cache_lens=128, page_size=16, chunk_size=64)
    layers = [m for m in model.modules() if getattr(m, "layerwise", None) is not None]
    assert len(layers) == 3 and layers[0].layerwise.next is layers[1].layerwise
    assert all((m.layerwise.tiles is not None) == (path == "tiles") for m in layers)
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    results = _prefill_on_cpu_and_gpu(engine, ids)
    # A layer too large for prefill_gpu_group_mb goes in groups of experts (three here, of 3, 3 and 2),
    # each staged while the one before computes: the same logits to the bit
    spec = layers[0].layerwise.spec
    for m in layers:
        assert m.layerwise.groups == [(0, spec.experts)]
        m.layerwise.groups = expert_groups(spec.experts, 3 * spec.hidden * spec.intermediate * 2,
                                           3 * 3 * spec.hidden * spec.intermediate * 2)
    assert len(layers[0].layerwise.groups) == 3
    seq = engine.new_sequence()
    assert torch.equal(engine.prefill(seq, ids).float().cpu(), results[1])
    engine.release(seq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deferred_experts_through_the_doorbell_equal_the_host_calls(tmp_path):
    """n_deferred_experts: with the doorbell, each layer's deferred experts run after its `done`
    is set, while the stream goes on to the next layer; with host functions they run in the same
    job before it. Both give the same decode (CUDA graphs and eager), which is not the decode
    without deferral."""
    from ktransformers.operators.experts import set_expert_deferral
    hf = tiny_model("qwen3_moe", layers=3)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    model = build_skeleton(hf.config, torch.bfloat16)
    optimize_and_load_gguf(model, gpu_rules("qwen3_moe", tmp_path, "cuda", "n_deferred_experts: 1"),
                           tmp_path / "m.gguf", hf.config)
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(13)).tolist()
    runs = {}
    for handoff, defer, graphs in (("doorbell", 1, True), ("doorbell", 1, False), ("host", 1, False),
                                   ("doorbell", 0, True)):
        _use_staging(model, handoff, pack=False)
        set_expert_deferral(model, defer)
        engine = Engine(model, cache_lens=64, page_size=16, chunk_size=8, use_cuda_graph=graphs)
        seq = engine.new_sequence()
        engine.prefill(seq, ids[:7])
        runs[handoff, defer, graphs] = torch.stack([engine.decode(seq, t)[0] for t in ids[7:]]).float().cpu()
        model.kt_context.check_host_errors()
    want = runs["host", 1, False]
    for key in (("doorbell", 1, True), ("doorbell", 1, False)):
        err = ((runs[key] - want).norm() / want.norm()).item()
        assert err < 1e-3, (key, err)
    assert ((runs["doorbell", 0, True] - want).norm() / want.norm()).item() > 1e-2
