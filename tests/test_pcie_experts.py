"""The GPU's share of a decode token's experts, read from the CPU kernel's tiles
(kernels/triton/pcie_experts.py), against the torch MoE formula on the dequantized weights: in
Triton's interpreter on the CPU, and on CUDA from device memory and from page-locked host memory.
The kernels' tests are marked `triton`; the option's parsing and its cost model need no Triton."""
import numpy as np
import pytest
import torch
from tiny import kernel_device

from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, tile_weights
from ktransformers.operators.experts import moe_reference
from ktransformers.weights import ggml_quants as gq


@pytest.fixture(scope="module")
def runtime():
    return CPURuntime(2)


def experts(runtime, types, E, H, I, seed):
    """(tiles of gate, up, down as uint8 tensors, their ggml types, gate_up [E, 2I, H], down [E, H, I])."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((E, I, H), (E, I, H), (E, H, I))
    tiles, dense = [], []
    for name, shape in zip(types, shapes):
        t = gq.ggml_type(name)
        raw = gq.random_blocks(t, shape[0] * shape[1] * shape[2] // 256, g).reshape(-1)
        w = tile_weights(runtime, ExpertWeights(raw, int(t)), shape[0] * shape[1], shape[2])
        if not w.tiled:
            pytest.skip(f"this build ({runtime.isa}) has no 16-row tiles of {name}: the share reads only tiles")
        tiles.append(w.data)
        dense.append(gq.dequantize(raw, t, shape))
    return tiles, tuple(int(gq.ggml_type(n)) for n in types), torch.cat(dense[:2], dim=1), dense[2]


def routing(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=g)


def gguf_dequantize(raw: torch.Tensor, t, shape) -> torch.Tensor:
    """gguf-py's numpy dequantization of the blocks `raw` (uint8): the independent reference, float32 [shape]."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    values = quants.dequantize(raw.cpu().numpy().reshape(-1, gq.FORMATS[gq.ggml_type(t)].block_bytes),
                               GGMLQuantizationType(int(t)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.triton
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", "Q4_K")])
@pytest.mark.parametrize("T,K,share,E,H,I", [(1, 4, 1, 5, 512, 256), (1, 8, 3, 9, 256, 512), (3, 4, 2, 6, 512, 256)])
def test_share_matches_reference(runtime, types, T, K, share, E, H, I):
    from ktransformers.kernels.triton.pcie_experts import pcie_experts
    dev = kernel_device()
    tiles, tids, gate_up, down = experts(runtime, types, E, H, I, seed=T * 100 + K + len(types[0]))
    ids, w = routing(T, K, E, seed=E + H)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(H + I)).to(torch.bfloat16)
    col0 = K - share
    want = moe_reference(x.float(), ids[:, col0:], w[:, col0:], gate_up, down)
    got = pcie_experts(x.to(dev), ids.to(dev), w.to(dev), col0, *(t.to(dev) for t in tiles), tids, E, I)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert rel_err(got.cpu(), want) < 1e-5
    # the other columns are left out: not the whole top-k's sum
    assert rel_err(got.cpu(), moe_reference(x.float(), ids, w, gate_up, down)) > 1e-2


@pytest.mark.triton
def test_share_flags_ids_out_of_range(runtime):
    from ktransformers.kernels.triton.pcie_experts import pcie_experts
    dev = kernel_device()
    E, H, I = 4, 256, 256
    tiles, tids, _, _ = experts(runtime, ("Q4_K", "Q4_K", "Q6_K"), E, H, I, seed=7)
    x = torch.randn(2, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, E], [3, -1], [1, -2]])
    y = pcie_experts(x.to(dev).repeat(2, 1), ids.to(dev), torch.rand(4, 2).to(dev), 1,
                     *(t.to(dev) for t in tiles), tids, E, I).cpu()
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()  # token 1's share names expert E
    assert torch.equal(y[2], torch.zeros(H)) and torch.isnan(y[3]).all()  # -1 is left out, -2 flagged


@pytest.mark.triton
def test_share_checks_its_arguments(runtime):
    from ktransformers.kernels.triton.pcie_experts import pcie_experts, supports
    E, H, I = 4, 256, 256
    tiles, tids, _, _ = experts(runtime, ("Q4_K", "Q4_K", "Q6_K"), E, H, I, seed=8)
    x, (ids, w) = torch.randn(1, H), routing(1, 2, E, 3)
    with pytest.raises(ValueError, match="down must be"):
        pcie_experts(x, ids, w, 1, tiles[0], tiles[1], tiles[2][:-1], tids, E, I)
    with pytest.raises(ValueError, match="col0"):
        pcie_experts(x, ids, w, 2, *tiles, tids, E, I)
    assert supports(tids, (True,) * 3, H, I) is None
    assert "16-row tiles" in supports(tids, (True, False, True), H, I)
    assert "Q8_0" in supports((int(gq.GGMLType.Q8_0),) + tids[1:], (True,) * 3, H, I)
    assert "multiples of 256" in supports(tids, (True,) * 3, H, 768 + 16)


@pytest.mark.triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_share_reads_page_locked_host_memory(runtime):
    """The tiles stay in (registered) host memory; the kernels read them over the bus."""
    from ktransformers.kernels.triton.pcie_experts import HostRegistration, pcie_experts
    E, H, I, K = 8, 512, 256, 4
    tiles, tids, gate_up, down = experts(runtime, ("Q4_K", "Q4_K", "Q6_K"), E, H, I, seed=11)
    pinned = HostRegistration(tiles)
    ids, w = routing(1, K, E, 12)
    x = torch.randn(1, H).to(torch.bfloat16)
    got = pcie_experts(x.cuda(), ids.cuda(), w.cuda(), 2, *tiles, tids, E, I)
    assert rel_err(got.cpu(), moe_reference(x.float(), ids[:, 2:], w[:, 2:], gate_up, down)) < 1e-5
    pinned.close()
    pinned.close()  # (twice: a no-op)


def _load_tiny_qwen3_cpu(tmp_path):
    """A function loading a 1-layer tiny Qwen3-MoE (Q4_K_M GGUF) through the shipped CPU rules,
    its experts rule given pcie_experts=(the argument)."""
    from test_models import q4_k_m
    from tiny import RULES, tiny_model, with_experts_kwargs

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("qwen3_moe", layers=1)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)

    def load(pcie_experts):
        rules = with_experts_kwargs(RULES_DIR / RULES["qwen3_moe"], tmp_path, pcie_experts=pcie_experts)
        model = build_skeleton(hf.config, torch.float32)
        optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)
        return model
    return load


def test_option_values_are_checked(tmp_path):
    """pcie_experts: a bad value names the layer (with CUDA or without)."""
    load = _load_tiny_qwen3_cpu(tmp_path)
    with pytest.raises(ValueError, match="mlp.experts: pcie_experts .* integer or 'auto', got 'two'"):
        load("two")
    with pytest.raises(ValueError, match=r"pcie_experts must lie in \[0, 1\] \(top-k 2\), got 2"):
        load(2)  # the tiny model routes 2 a token


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA's case")
def test_option_is_off_without_cuda(tmp_path):
    """pcie_experts on a machine without CUDA: off with a warning, the model the all-CPU one."""
    from ktransformers.operators.experts import KExpertsCPU
    load = _load_tiny_qwen3_cpu(tmp_path)
    with pytest.warns(UserWarning, match="pcie_experts=1 is off: no CUDA device"):
        model = load(1)
    ops = [m.ops["generate"] for m in model.modules() if isinstance(getattr(m, "ops", {}).get("generate"), KExpertsCPU)]
    assert ops and all(op.pcie is None for op in ops)


def test_auto_share_size_model():
    """pcie_experts "auto"'s choice (pcie_share_size) at random rates and sizes: within [0, K);
    a faster bus never takes fewer experts, a faster CPU never more; 0 where the CPU's whole
    top-k takes less than the GPU's fixed cost; and the sizes measured on the H200 host: 2 of 8
    Qwen3-30B-A3B experts (3.06 MB) at CPU probes of 90-130 GB/s beside a 51 GB/s bus (a share
    of 3 there was slower than none, 2 faster), none of Mixtral's two 106 MB experts."""
    from ktransformers.operators import experts as ex
    g = torch.Generator().manual_seed(5)
    for _ in range(300):
        K = int(torch.randint(1, 17, (1,), generator=g))
        B = int(torch.randint(1 << 10, 64 << 20, (1,), generator=g))
        bus, cpu = (float(v) for v in torch.rand(2, generator=g) * 200 + 5)
        n = ex.pcie_share_size(K, B, bus, cpu)
        assert 0 <= n < K
        assert ex.pcie_share_size(K, B, bus * 1.5, cpu) >= n, (K, B, bus, cpu)
        assert ex.pcie_share_size(K, B, bus, cpu * 1.5) <= n, (K, B, bus, cpu)
        if K * B / (cpu * ex.BUS_SHARE_COSTS.cpu_kernel * 1e9) <= ex.BUS_SHARE_COSTS.gpu_overhead_s:
            assert n == 0
    assert [ex.pcie_share_size(8, 3_060_000, 51.0, cpu) for cpu in (90, 109, 130)] == [2, 2, 2]
    assert ex.pcie_share_size(2, 106_000_000, 51.0, 120.0) == 0
    assert ex.pcie_share_size(3, 118_000, 51.0, 20.0) == 0  # (a tiny test model's experts)


class _Context:
    """The part of a RunContext that auto_pcie_experts reads."""

    def __init__(self, rates=None, runtime=None):
        self.pcie_rates, self._runtime = rates, runtime

    def cpu_runtime(self):
        return self._runtime


@pytest.mark.triton
def test_auto_measures_once_and_fails_quietly_to_off(monkeypatch):
    """auto_pcie_experts: experts under BUS_SHARE_COSTS.min_expert_bytes are 0 with nothing measured;
    the rates are measured once per context and the choice is pcie_share_size's; a failed
    measurement warns and leaves the share off (0) instead of failing the load."""
    import warnings

    from ktransformers.kernels.triton import pcie_experts as pe
    from ktransformers.operators import experts as ex

    class Runtime:
        calls = 0

        def stream_gbps(self, seconds, rounds):
            Runtime.calls += 1
            return 109.0
    buses = []
    monkeypatch.setattr(pe, "bus_read_gbps", lambda device: buses.append(device) or 51.0)
    ctx = _Context(runtime=Runtime())
    assert ex.auto_pcie_experts(ctx, 8, ex.BUS_SHARE_COSTS.min_expert_bytes - 1) == 0 and ctx.pcie_rates is None
    got = [ex.auto_pcie_experts(ctx, 8, 3_060_000) for _ in range(3)]
    assert got == [ex.pcie_share_size(8, 3_060_000, 51.0, 109.0)] * 3 and got[0] > 0
    assert len(buses) == 1 and Runtime.calls == 1 and ctx.pcie_rates == (51.0, 109.0)

    def broken(device):
        raise RuntimeError("cudaHostAlloc: out of memory")
    monkeypatch.setattr(pe, "bus_read_gbps", broken)
    ctx = _Context(runtime=Runtime())
    with pytest.warns(UserWarning, match="pcie_experts auto is off: measuring .* RuntimeError: cudaHostAlloc"):
        assert ex.auto_pcie_experts(ctx, 8, 3_060_000) == 0
    with warnings.catch_warnings():  # (measured once: no second try, no second warning)
        warnings.simplefilter("error")
        assert ex.auto_pcie_experts(ctx, 8, 3_060_000) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA's case")
def test_auto_is_quietly_off_without_cuda(tmp_path):
    """pcie_experts: auto (the GPU rule files' default) on a machine without CUDA: off, no warning."""
    import warnings

    from ktransformers.operators.experts import KExpertsCPU
    load = _load_tiny_qwen3_cpu(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pcie_experts")
        model = load("auto")
    ops = [m.ops["generate"] for m in model.modules() if isinstance(getattr(m, "ops", {}).get("generate"), KExpertsCPU)]
    assert ops and all(op.pcie is None for op in ops)


@pytest.mark.triton
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("E,R,C", [(1, 16, 256), (3, 48, 512), (2, 32, 768)])
def test_dequantize_tiles_equals_the_blocks(runtime, name, E, R, C):
    """The CPU kernel's 16-row tiles dequantized where they lie (layer-wise prefill's path): the
    values of the GGUF blocks they were made from, as gguf-py dequantizes them (rounded once to
    bf16), to the bit; into a strided view (gate into gate_up's first rows) and past a group's
    first expert too."""
    from ktransformers.kernels.triton.pcie_experts import TILE_BYTES, dequantize_tiles
    dev = kernel_device()
    t = gq.ggml_type(name)
    raw = gq.random_blocks(t, E * R * C // 256, torch.Generator().manual_seed(E * R + C)).reshape(-1)
    w = tile_weights(runtime, ExpertWeights(raw, int(t)), E * R, C)
    if not w.tiled:
        pytest.skip(f"this build ({runtime.isa}) has no 16-row tiles of {name}")
    want = gguf_dequantize(raw, t, (E, R, C)).bfloat16()
    both = torch.full((E, 2 * R, C), float("nan"), dtype=torch.bfloat16, device=dev)
    got = dequantize_tiles(w.data.to(dev), int(t), (E, R, C), both[:, :R])
    assert torch.equal(got.cpu(), want) and torch.isnan(both[:, R:].float()).all()
    for programs in (1, 3):  # fewer programs than runs of tiles: each takes every programs-th run
        capped = dequantize_tiles(w.data.to(dev), int(t), (E, R, C),
                                  torch.full((E, R, C), float("nan"), dtype=torch.bfloat16, device=dev), programs)
        assert torch.equal(capped.cpu(), want), programs
    per = w.data.numel() // E  # the last expert alone, from its own bytes
    last = dequantize_tiles(w.data[per * (E - 1):].to(dev), int(t), (1, R, C),
                            torch.empty(1, R, C, dtype=torch.float32, device=dev))
    assert torch.equal(last.cpu().bfloat16(), want[E - 1:])
    with pytest.raises(ValueError, match="tiles of"):
        dequantize_tiles(w.data[:-1].to(dev), int(t), (E, R, C), both[:, :R])
    with pytest.raises(ValueError, match="Q4_K and Q6_K only"):
        dequantize_tiles(w.data.to(dev), int(gq.ggml_type("Q8_0")), (E, R, C), both[:, :R])
    assert TILE_BYTES[int(t)] * (R // 16) * (C // 256) == per


@pytest.mark.triton
def test_layerwise_group_from_tiles_equals_from_the_blocks(runtime):
    """Layer-wise prefill's two ways of making a group of experts bf16 (tiles read in place, or
    the GGUF's blocks) give gguf-py's values of that group's experts (rounded once to bf16), to
    the bit, for every group of a layer."""
    from ktransformers.kernels.triton.dequant import dequantize
    from ktransformers.kernels.triton.pcie_experts import dequantize_tiles
    from ktransformers.operators.experts import ExpertSpec, LayerwisePrefill, expert_groups
    dev = kernel_device()
    E, H, I = 5, 256, 512
    g = torch.Generator().manual_seed(21)
    raws, tiles, types = [], [], []
    for name, (rows, cols) in zip(("Q4_K", "Q4_K", "Q6_K"), ((I, H), (I, H), (H, I))):
        t = gq.ggml_type(name)
        raw = gq.random_blocks(t, E * rows * cols // 256, g).reshape(-1)
        w = tile_weights(runtime, ExpertWeights(raw, int(t)), E * rows, cols)
        if not w.tiled:
            pytest.skip(f"this build ({runtime.isa}) has no 16-row tiles of {name}")
        raws.append(raw.to(dev))
        tiles.append(w.data.to(dev))
        types.append(int(t))
    lw = LayerwisePrefill(ExpertSpec("blk.0", E, H, I, 2, torch.bfloat16), torch.device(dev))
    lw.groups = expert_groups(E, 1, 2)  # groups of two experts: (0, 2), (2, 4), (4, 5)
    whole = [gguf_dequantize(r, t, s).bfloat16().to(dev)
             for r, t, s in zip(raws, types, ((E, I, H), (E, I, H), (E, H, I)))]
    for group, (e0, e1) in enumerate(lw.groups):
        from_blocks = lw._to_bf16(group, [(lw._own(r, group), t) for r, t in zip(raws, types)], dequantize)
        from_tiles = lw._to_bf16(group, [(lw._own(x, group), t) for x, t in zip(tiles, types)], dequantize_tiles)
        for got in (from_blocks, from_tiles):
            assert torch.equal(got[0], torch.cat([whole[0][e0:e1], whole[1][e0:e1]], 1))
            assert torch.equal(got[1], whole[2][e0:e1])
