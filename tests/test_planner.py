"""The multi-GPU planner: layer runs and hot experts from GPU budgets, the rule file it writes,
and the shipped DeepSeek-V3 rule files for 2, 4 and 8 GPUs."""
import pytest
import torch
import yaml
from tiny import tiny_model
from transformers import DeepseekV3Config

from ktransformers.loader import RULES_DIR, build_skeleton, check_experts_placed
from ktransformers.optimize.inject import plan
from ktransformers.optimize.memory import GIB
from ktransformers.optimize.planner import main as planner_main
from ktransformers.optimize.planner import plan_gpus, write_rules
from ktransformers.optimize.rules import parse_rules

MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_model("deepseek_v3", layers=6)
    return build_skeleton(hf.config, torch.bfloat16), hf.config


def layer_of(name):
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def check_rules(model, placement, text, experts_key="mlp.experts"):
    rows = plan(model, parse_rules(text))
    check_experts_placed(rows, "generated")
    gpu_of = {i: g for g, layers in placement.layers.items() for i in layers}
    for r in rows:
        i = layer_of(r.name)
        if r.rule is None:
            continue
        if r.name.endswith(experts_key):  # routed experts: on the CPU, output (and hot experts) on the layer's GPU
            assert r.kwargs["out_device"] == gpu_of[i] and r.kwargs["generate_device"] == "cpu"
            assert r.kwargs.get("num_gpu_experts", 0) == placement.hot_experts[gpu_of[i]]
        elif i is not None:
            assert r.device == gpu_of[i], f"{r.name} on {r.device}, planned {gpu_of[i]}"
    device = {r.name: r.device for r in rows if r.rule is not None}
    assert device["model.embed_tokens"] == placement.gpus[0]
    assert device["lm_head"] == device["model.norm"] == placement.gpus[-1]


def test_equal_budgets_split_the_layers_evenly(tiny):
    model, config = tiny
    p = plan_gpus(model, config, {"cuda:0": 8 * MIB, "cuda:1": 8 * MIB}, cache_lens=1024, reserve=MIB)
    assert [len(p.layers[g]) for g in p.gpus] == [3, 3]
    assert sum(p.layers.values(), []) == list(range(6))  # contiguous, in order, every layer once
    assert all(n > 0 for n in p.hot_experts.values())
    for g in p.gpus:
        assert sum(p.bytes[g].values()) <= p.budgets[g]
    check_rules(model, p, write_rules(p, yaml.safe_load((RULES_DIR / "DeepSeek-V3-Chat.yaml").read_text())))


def test_a_bigger_gpu_takes_more_layers_and_a_tight_one_no_hot_experts(tiny):
    model, config = tiny
    p = plan_gpus(model, config, {"cuda:0": 20 * MIB, "cuda:1": 5 * MIB, "cuda:2": 5 * MIB}, cache_lens=1024,
                  reserve=MIB)
    counts = [len(p.layers[g]) for g in p.gpus]
    assert counts[0] > counts[1] and sum(counts) == 6
    tight = plan_gpus(model, config, {"cuda:0": int(3.2 * MIB), "cuda:1": int(3.2 * MIB)}, cache_lens=1024,
                      reserve=MIB)
    assert min(tight.hot_experts.values()) < max(p.hot_experts.values())
    check_rules(model, p, write_rules(p, yaml.safe_load((RULES_DIR / "DeepSeek-V3-Chat.yaml").read_text())))


def test_planned_qwen3_rules_keep_the_decoder_layer_rule():
    """The Qwen3-MoE GPU rules wrap each decoder layer (model.layers.N itself, no dot after it) in
    KDecoderLayer: the planner's per-GPU copies of that rule still match every layer, on its GPU."""
    hf = tiny_model("qwen3_moe", layers=4)
    model = build_skeleton(hf.config, torch.bfloat16)
    p = plan_gpus(model, hf.config, {"cuda:0": 8 * MIB, "cuda:1": 8 * MIB}, cache_lens=1024, reserve=MIB)
    text = write_rules(p, yaml.safe_load((RULES_DIR / "Qwen3Moe.yaml").read_text()))
    check_rules(model, p, text)
    rows = {r.name: r for r in plan(model, parse_rules(text))}
    gpu_of = {i: g for g, layers in p.layers.items() for i in layers}
    for i in range(4):
        row = rows[f"model.layers.{i}"]
        assert row.operator.endswith("KDecoderLayer") and row.device == gpu_of[i], row


def test_too_small_budgets_are_refused(tiny):
    model, config = tiny
    with pytest.raises(ValueError, match="the layers do not fit the GPUs: .* lower --cache_lens or add GPUs"):
        plan_gpus(model, config, {"cuda:0": 2 * MIB, "cuda:1": 2 * MIB}, cache_lens=1024, reserve=MIB)
    with pytest.raises(ValueError, match="no GPU budget"):
        plan_gpus(model, config, {"cpu": 100 * GIB})


@pytest.mark.parametrize("n", [2, 4, 8])
def test_shipped_deepseek_multi_gpu_rule_files(n):
    """The files scripts/make_multi_gpu_rules.py wrote: they parse, place every module of
    DeepSeek-V3 (61 layers, 256 experts) and put each layer on one of the n GPUs."""
    config = DeepseekV3Config()
    model = build_skeleton(config, torch.bfloat16)
    text = (RULES_DIR / f"DeepSeek-V3-Chat-multi-gpu-{n}.yaml").read_text()
    placement = plan_gpus(model, config, {f"cuda:{g}": 24 * GIB for g in range(n)}, cache_lens=32768)
    check_rules(model, placement, text)
    rows = plan(model, parse_rules(text))
    assert {r.device for r in rows if r.rule is not None and layer_of(r.name) is not None} == \
        {f"cuda:{g}" for g in range(n)} | {"cpu"}  # (cpu: the routed experts)


def test_planner_cli(tmp_path, capsys):
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("qwen3_moe", layers=4)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict())
    out = tmp_path / "rules.yaml"
    assert planner_main(["--gguf_path", str(tmp_path / "m.gguf"), "--gpu_memory", "0:64MiB,1:64MiB", "--reserve",
                         "0.01", "--cache_lens", "512", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cuda:0" in text and "cuda:1" in text and out.is_file()
    assert "Qwen3MoeAttention" in out.read_text()
    assert planner_main(["--gguf_path", str(tmp_path / "m.gguf"), "--gpu_memory", "0:1MiB", "--dry-run"]) == 2


def test_ram_row_counts_the_stored_experts(tmp_path):
    """With the GGUF, the plan lists the routed experts' stored bytes on the CPU (all of them:
    the kernels compute on the mapped file, hot experts included) and warns past a RAM budget."""
    from test_models import q4_k_m

    from ktransformers.weights.gguf import GGUFFileSet, GGUFSource
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    stored = sum(info.data.nbytes for name, info in GGUFFileSet(tmp_path / "m.gguf").tensors.items() if "_exps." in name)
    model = build_skeleton(hf.config, torch.bfloat16)
    p = plan_gpus(model, hf.config, {"cuda:0": 64 * MIB, "cpu": stored + 1}, GGUFSource(tmp_path / "m.gguf"),
                  cache_lens=256, reserve=MIB)
    assert p.bytes["cpu"] == {"routed experts (mapped file)": stored}
    assert p.ram_warning() is None and "cpu" in p.format()
    tight = plan_gpus(model, hf.config, {"cuda:0": 64 * MIB, "cpu": stored - 1}, GGUFSource(tmp_path / "m.gguf"),
                      cache_lens=256, reserve=MIB)
    assert "exceed the RAM budget" in tight.ram_warning()
