"""Memory planning: the bytes each device will hold, computed before loading, and the refusal
when a device's budget is exceeded."""
import math

import pytest
import torch
from test_models import q4_k_m
from tiny import GPU_RULES, RULES, tiny_model

from ktransformers import load_model
from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.optimize.__main__ import main as optimize_main
from ktransformers.optimize.inject import plan
from ktransformers.optimize.memory import MemoryBudgetError, check_budget, parse_memory, plan_memory
from ktransformers.optimize.rules import load_rules
from ktransformers.weights.ggml_quants import GGMLType, tensor_nbytes
from ktransformers.weights.gguf import GGUFSource
from ktransformers.weights.gguf_write import write_gguf


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("mem") / "m.gguf"
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(path, hf.config, hf.state_dict(), types=q4_k_m)
    return path, hf.config


def memory(path, config, rule_file, cache_lens=1000):
    model = build_skeleton(config, torch.bfloat16)
    rows = plan(model, load_rules(RULES_DIR / rule_file))
    return plan_memory(model, rows, GGUFSource(path), config, torch.bfloat16, cache_lens=cache_lens)


def stored_bytes(path, pattern):
    src = GGUFSource(path)
    return sum(tensor_nbytes(t.ggml_type, math.prod(t.shape)) for n, t in src.files.tensors.items() if pattern in n)


def test_cpu_rules_count_the_mapped_file(qwen3):
    path, config = qwen3
    kinds = memory(path, config, RULES["qwen3_moe"]).per_device_kind()
    assert set(kinds) == {"cpu"}
    assert kinds["cpu"]["experts (mapped file)"] == stored_bytes(path, "_exps.")
    head_dim = config.head_dim
    assert kinds["cpu"]["KV cache"] == 2 * config.num_key_value_heads * head_dim * 1024 * config.num_hidden_layers * 2


def test_gpu_rules_put_dense_parts_and_cache_on_the_gpu(qwen3):
    path, config = qwen3
    kinds = memory(path, config, GPU_RULES["qwen3_moe"]).per_device_kind()
    src = GGUFSource(path)
    layers = [sum(tensor_nbytes(t.ggml_type, math.prod(t.shape)) for n, t in src.files.tensors.items()
                  if n.startswith(f"blk.{i}.") and "_exps." in n) for i in range(config.num_hidden_layers)]
    # layer-wise prefill stages the stored experts in a ring of eight page-locked 32 MiB chunks,
    # whatever the layers' size
    assert kinds["cpu"] == {"experts (mapped file)": stored_bytes(path, "_exps."),
                            "layer-wise prefill staging (pinned)": 8 * (32 << 20)}
    gpu = kinds["cuda:0"]
    assert gpu["KV cache"] > 0 and gpu["graph buffers"] > 0
    # the tiny model's layer is one group: its experts in bf16, and the next group arriving (two
    # copies of its stored bytes, or in bf16 where it is read from the CPU's tiles)
    bf16 = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 2
    assert gpu["layer-wise prefill buffers"] == bf16 + max(bf16, 2 * max(layers))
    # Q4_K attention projections become int4 + 8 bytes of scale/offset per 32 weights
    src = GGUFSource(path)
    q4 = [t for n, t in src.files.tensors.items() if n.startswith("blk.") and "attn_q." in n]
    assert all(t.ggml_type == GGMLType.Q4_K for t in q4)
    assert gpu["weights"] >= sum(math.prod(t.shape) * 0.75 for t in q4)


def test_layerwise_groups_set_its_gpu_share(qwen3, tmp_path):
    """prefill_gpu_group_mb (an experts rule option) bounds what layer-wise prefill holds on the
    GPU: a group of experts in bf16 and the next one arriving; the rule file with a value under 1
    is refused."""
    path, config = qwen3
    text = (RULES_DIR / GPU_RULES["qwen3_moe"]).read_text()
    assert "prefill_gpu_threshold: 512" in text
    expert_mib = 3 * config.hidden_size * config.moe_intermediate_size * 2 / 2**20  # 0.375 MiB in bf16
    small = tmp_path / "small.yaml"
    small.write_text(text.replace("prefill_gpu_threshold: 512", "prefill_gpu_threshold: 512\n      prefill_gpu_group_mb: 1"))
    model = build_skeleton(config, torch.bfloat16)
    rows = plan(model, load_rules(small))
    got = plan_memory(model, rows, GGUFSource(path), config, torch.bfloat16, cache_lens=1000).per_device_kind()
    group = int(1 / expert_mib) * expert_mib * 2**20  # two experts a group
    assert got["cuda:0"]["layer-wise prefill buffers"] == group + group  # the next group, in bf16, is larger
    default = memory(path, config, GPU_RULES["qwen3_moe"]).per_device_kind()["cuda:0"]["layer-wise prefill buffers"]
    assert default > 2 * group
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("prefill_gpu_threshold: 512", "prefill_gpu_threshold: 512\n      prefill_gpu_group_mb: 0"))
    with pytest.raises(ValueError, match=r"bad\.yaml.*prefill_gpu_group_mb: must be at least 1, got 0"):
        load_rules(bad)


def test_budget_refusal_names_the_device_and_what_to_do(qwen3):
    path, config = qwen3
    mem = memory(path, config, GPU_RULES["qwen3_moe"])
    need = mem.per_device()["cuda:0"]
    check_budget(mem, {"cuda:0": need, "cpu": 1 << 40})  # exactly enough
    with pytest.raises(MemoryBudgetError, match=r"cuda:0 needs .* but has 1.00 MiB free: lower --cache_lens"):
        check_budget(mem, {"cuda:0": 1 << 20, "cpu": 1 << 40})
    # the CPU kernels' experts are mapped file pages: not counted against RAM
    check_budget(memory(path, config, RULES["qwen3_moe"], cache_lens=16), {"cpu": 1 << 20})


def test_load_model_refuses_before_loading(qwen3):
    path, _ = qwen3
    with pytest.raises(MemoryBudgetError, match=r"^the model does not fit: cpu needs"):
        load_model(path, tokenizer=False, progress=False, cache_lens=1 << 20, memory_budget={"cpu": 1 << 20})


def test_cpu_tiles_only_where_ram_holds_them(qwen3):
    """The CPU kernels' weights are repacked into tiles (RAM copies) when RAM holds them beside
    the rest (and the kernels have tiles: AVX512-VNNI); else they stay in the mapped file, with a
    warning, and the model still loads."""
    from ktransformers.kernels.cpu import load_extension
    path, _ = qwen3

    def experts_tiled(loaded):
        op = next(m for n, m in loaded.model.named_modules() if n.endswith("mlp.experts")).ops["generate"]
        return [w.tiled for w in op.kernel._weights]

    roomy = load_model(path, tokenizer=False, progress=False, cache_lens=64, memory_budget={"cpu": 1 << 40})
    assert any(experts_tiled(roomy)) == load_extension().has_tiles(int(GGMLType.Q4_K))
    with pytest.warns(UserWarning, match="stay in the mapped file"):
        tight = load_model(path, tokenizer=False, progress=False, cache_lens=64, memory_budget={"cpu": 1 << 30})
    assert not any(experts_tiled(tight))


def test_parse_memory():
    assert parse_memory("0:20GiB, 1:512MiB,cpu:1TB") == {"cuda:0": 20 << 30, "cuda:1": 512 << 20, "cpu": 10**12}
    assert parse_memory("cuda:2=1.5GiB") == {"cuda:2": int(1.5 * (1 << 30))}
    with pytest.raises(ValueError, match="cannot read memory budget 'x:3'"):
        parse_memory("x:3")


def test_dry_run_prints_the_memory_plan(qwen3, capsys):
    path, _ = qwen3
    assert optimize_main(["--gguf_path", str(path), "--dry-run", "--cache_lens", "512"]) == 0
    out = capsys.readouterr().out
    assert "memory (KV cache of 512 tokens" in out and "experts (mapped file)" in out


def test_calibrate_counts_routing_of_the_demo_model(tmp_path):
    """python -m ktransformers.calibrate writes per-layer routing counts that hot experts read."""
    from ktransformers.calibrate import main as calibrate
    from ktransformers.operators.experts import hot_experts
    out = tmp_path / "counts.json"
    assert calibrate(["--prompt", "The Python tutorial explains lists.", "--prompt", "Modules are files.",
                      "--out", str(out), "--cpu_infer", "2"]) == 0
    import json
    counts = json.loads(out.read_text())
    from ktransformers.demo import DEMO_HF_DIR
    config = json.loads((DEMO_HF_DIR / "config.json").read_text())
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    assert len(counts) == moe_layers
    key, per_expert = next(iter(counts.items()))
    assert key.endswith(".mlp.experts") and len(per_expert) == config["n_routed_experts"]
    totals = {sum(v) for v in counts.values()}
    assert len(totals) == 1 and totals.pop() % config["num_experts_per_tok"] == 0  # every token counted K times
    top = hot_experts(key, 2, len(per_expert), str(out))
    assert sorted(per_expert, reverse=True)[:2] == sorted((per_expert[e] for e in top), reverse=True)


def test_hybrid_model_plans_its_kv_pages_and_recurrent_states(tmp_path):
    """Qwen3-Next: K/V pages for its full-attention layers only, and each linear layer's recurrent
    states for max_batch sequences, as many bytes as the cache the engine makes holds."""
    from ktransformers.cache import make_cache
    hf = tiny_model("qwen3_next")
    path = tmp_path / "m.gguf"
    write_gguf(path, hf.config, hf.state_dict(), types=q4_k_m)
    kinds = memory(path, hf.config, RULES["qwen3_next"], cache_lens=1000).per_device_kind()["cpu"]
    cache = make_cache(hf.config, 1000, page_size=256, dtype=torch.bfloat16, max_seqs=8)
    states = sum(t.numel() * t.element_size() for d in (cache.conv, cache.ssm) for t in d.values())
    assert kinds["recurrent states"] == states > 0
    assert kinds["KV cache"] == cache.bytes() - states > 0
