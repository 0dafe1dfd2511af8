"""Layers spread over two GPUs by the planner's rule file: the engine's logits (prefill, decode,
two sequences in one step) equal the same rules on one GPU, and the CUDA graphs per device
segment replay what the eager pipeline computes. Needs two CUDA devices."""
import pytest
import torch
import yaml
from test_models import q4_k_m
from tiny import GPU_RULES, tiny_model

from ktransformers import optimize_and_load_gguf
from ktransformers.engine.generate import Engine
from ktransformers.engine.graphs import unsupported
from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.optimize.planner import plan_gpus, write_rules
from ktransformers.weights.gguf import GGUFSource
from ktransformers.weights.gguf_write import write_gguf

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

MIB = 1 << 20


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def split(request, tmp_path_factory):
    """(config, GGUF path, the planner's two-GPU rules, the same rules on GPU 0 alone)."""
    family, tmp = request.param, tmp_path_factory.mktemp(request.param)
    hf = tiny_model(family, layers=4)
    write_gguf(tmp / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    skeleton = build_skeleton(hf.config, torch.bfloat16)
    placement = plan_gpus(skeleton, hf.config, {"cuda:0": 64 * MIB, "cuda:1": 64 * MIB}, GGUFSource(tmp / "m.gguf"),
                          cache_lens=256, reserve=MIB)
    assert [len(placement.layers[g]) for g in placement.gpus] == [2, 2]
    placement.hot_experts = {"cuda:0": 3, "cuda:1": 2}  # some experts on each GPU, the rest on the CPU
    text = write_rules(placement, yaml.safe_load((RULES_DIR / GPU_RULES[family]).read_text()))
    (tmp / "two.yaml").write_text(text)
    (tmp / "one.yaml").write_text(text.replace("cuda:1", "cuda:0"))
    return hf.config, tmp / "m.gguf", tmp / "two.yaml", tmp / "one.yaml"


def load(config, gguf, rules):
    model = build_skeleton(config, torch.bfloat16)
    optimize_and_load_gguf(model, rules, gguf, config)
    return model


def run(engine, ids):
    """Prefill in chunks, decode alone, then two sequences per step: every step's logits."""
    a, b = engine.new_sequence(), engine.new_sequence()
    out = [engine.prefill(a, ids[:13])[0], engine.prefill(b, ids[4:9])[0]]
    out += [engine.decode(a, t)[0] for t in ids[13:18]]
    for k in range(3):
        out += list(engine.step([a, b], [[ids[18 + k]], [ids[9 + k]]]))
    return torch.stack(out).float().cpu()


def test_two_gpus_equal_one(split):
    config, gguf, two, one = split
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    multi = load(config, gguf, two)
    engine = Engine(multi, cache_lens=128, page_size=8, chunk_size=5)
    devices = {str(d) for d in engine.layer_devices}
    assert devices == {"cuda:0", "cuda:1"}
    assert unsupported(engine) is None  # embeddings on the first GPU, norm and lm_head on the last
    got = run(engine, ids)
    ref = run(Engine(load(config, gguf, one), cache_lens=128, page_size=8, chunk_size=5), ids)
    err = rel_err(got, ref)
    assert err < 1e-2, f"two GPUs vs one: {err:.2e}"


def test_graph_segments_replay_the_eager_pipeline(split):
    config, gguf, two, _ = split
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    model = load(config, gguf, two)
    eager = run(Engine(model, cache_lens=128, page_size=8, chunk_size=5), ids)
    engine = Engine(model, cache_lens=128, page_size=8, chunk_size=5, use_cuda_graph=True, max_batch=2)
    graphed = run(engine, ids)
    assert [str(s.device) for s in engine.graphs.segments] == ["cuda:0", "cuda:1"]
    assert engine.graphs.batch_sizes == [1, 2]
    err = rel_err(graphed, eager)
    assert err < 1e-2, f"graph segments vs eager: {err:.2e}"
