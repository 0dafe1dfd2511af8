"""Operators against transformers' own modules on fresh random inputs at several shapes."""
import pytest
import torch
from tiny import tiny_config
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Experts,
    DeepseekV3TopkRouter,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from ktransformers.operators.base import set_phase
from ktransformers.operators.experts import KTransformersExperts, moe_reference
from ktransformers.operators.gate import KMoEGate, KMoEGateSoftmax
from ktransformers.operators.linear import KTransformersLinear
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.source import TensorInfo, WeightSource


class DictSource(WeightSource):
    """An in-memory WeightSource over a module's state dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.path, self.tensors = "<memory>", tensors

    def keys(self):
        return list(self.tensors)

    def info(self, name):
        return TensorInfo(GGMLType.F32, tuple(self.tensors[name].shape))

    def raw(self, name):
        return self.tensors[name].numpy().view("uint8").reshape(-1)

    def _load_stored(self, name, dtype=None):
        return self.tensors[name].to(dtype or self.tensors[name].dtype, copy=True)


def prefixed(prefix: str, module: nn.Module) -> DictSource:
    return DictSource({f"{prefix}.{k}": v for k, v in module.state_dict().items()})


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("T", [1, 3, 17, 128])
@pytest.mark.parametrize("E,K,H,I", [(8, 2, 64, 32), (7, 3, 48, 80), (16, 8, 32, 16)])
def test_experts_match_hf(T, E, K, H, I):
    config = tiny_config("deepseek_v3")
    config.n_routed_experts, config.hidden_size, config.moe_intermediate_size = E, H, I
    hf = DeepseekV3Experts(config)
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.1), hf.down_proj.normal_(0, 0.1)
    op = KTransformersExperts("m.experts", prefixed("m.experts", hf), config, hf)
    op.load()
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    assert rel_err(op(x, ids, w), hf(x, ids, w)) < 1e-5


def test_expert_ids_out_of_range_raise():
    config = tiny_config("deepseek_v3")
    hf = DeepseekV3Experts(config)
    op = KTransformersExperts("m.experts", prefixed("m.experts", hf), config, hf)
    op.load()
    x, w = torch.randn(2, config.hidden_size), torch.rand(2, 2)
    with pytest.raises(ValueError, match=r"m\.experts: expert ids must lie in \[0, 8\)"):
        op(x, torch.tensor([[0, 8], [1, 2]]), w)
    with pytest.raises(ValueError, match="in"):
        op(x, torch.tensor([[0, -1], [1, 2]]), w)
    with pytest.raises(ValueError, match="integer"):
        op(x, torch.ones(2, 2), w)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        op(x, torch.tensor([[0, 1]]), w)


def test_moe_reference_skips_unrouted_experts():
    x = torch.randn(5, 8)
    gate_up, down = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    ids, w = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    g, u = (x @ gate_up[0].T).chunk(2, dim=-1)
    expect = (torch.nn.functional.silu(g) * u) @ down[0].T
    assert torch.allclose(moe_reference(x, ids, w, gate_up, down), expect, atol=1e-5)


def _deepseek_v2_router(method: str):
    config = tiny_config("deepseek_v2")
    config.n_routed_experts, config.num_experts_per_tok, config.routed_scaling_factor = 16, 4, 16.0
    config.topk_method, config.n_group, config.topk_group = method, 4, 2
    return config, DeepseekV2TopkRouter(config)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "deepseek_v2-greedy", "deepseek_v2-group_limited_greedy"])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_deepseek_router_matches_hf(T, family):
    """KMoEGate against the router it replaces: DeepSeek-V3's and GLM-4.5's sigmoid ones (with the
    correction bias), DeepSeek-V2's softmax one in both of its top-k methods."""
    if family.startswith("deepseek_v2"):
        config, hf = _deepseek_v2_router(family.split("-")[1])
    else:
        config = tiny_config(family)
        hf = {"deepseek_v3": DeepseekV3TopkRouter, "glm4_moe": Glm4MoeTopkRouter}[family](config)
    with torch.no_grad():
        hf.weight.normal_(0, 0.1)
        if hasattr(hf, "e_score_correction_bias"):
            hf.e_score_correction_bias.normal_(0, 0.05)
    op = KMoEGate("g", prefixed("g", hf), config, hf)
    op.load()
    x = torch.randn(T, config.hidden_size)
    (l1, w1, i1), (l2, w2, i2) = op(x), hf(x)
    assert torch.allclose(l1, l2, atol=1e-5)  # few tokens: the C++ fp32 GEMV, another summation order
    o1, o2 = i1.sort(dim=-1), i2.sort(dim=-1)
    assert torch.equal(o1.values, o2.values)
    assert torch.allclose(w1.gather(1, o1.indices), w2.gather(1, o2.indices), atol=1e-6)


@pytest.mark.parametrize("router_cls, family", [(Qwen3MoeTopKRouter, "qwen3_moe"), (MixtralTopKRouter, "mixtral"),
                                               (GptOssTopKRouter, "gpt_oss")])
@pytest.mark.parametrize("T", [1, 9])
def test_softmax_router_matches_hf(router_cls, family, T):
    """KMoEGateSoftmax against the router it replaces; gpt-oss's has a bias and takes the softmax
    of its top-k logits alone."""
    config = tiny_config(family)
    hf = router_cls(config)
    with torch.no_grad():
        hf.weight.normal_(0, 0.1)
        if getattr(hf, "bias", None) is not None:
            hf.bias.normal_(0, 0.5)
    op = KMoEGateSoftmax("g", prefixed("g", hf), config, hf)
    op.load()
    x = torch.randn(T, config.hidden_size)
    for a, b in zip(op(x), hf(x)):
        assert a.dtype == b.dtype and torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 32), (3, 7, 32)])
def test_linear_matches_and_dispatches_by_phase(bias, shape):
    lin = nn.Linear(32, 24, bias=bias)
    op = KTransformersLinear("l", prefixed("l", lin), None, lin, prefill_op="KLinearTorch", generate_op="KLinearTorch")
    op.load()
    x = torch.randn(shape)
    assert torch.allclose(op(x), lin(x), atol=1e-6)
    assert op.ops["prefill"] is op.ops["generate"]  # same op and device: loaded once
    set_phase(op, "generate")
    assert op.phase == "generate" and torch.allclose(op(x), lin(x), atol=1e-6)
    with pytest.raises(ValueError, match="phase"):
        set_phase(op, "decode")


def test_operator_kwargs_are_checked_at_construction():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"KTransformersLinear at 'l': generate_op: 'KLinearNope' is not one of"):
        KTransformersLinear("l", None, None, lin, generate_op="KLinearNope")


def test_cpu_experts_op_checks_ids_itself():
    from ktransformers.operators.base import RunContext
    config = tiny_config("deepseek_v3")
    config.n_routed_experts, config.hidden_size, config.moe_intermediate_size = 5, 256, 256
    hf = DeepseekV3Experts(config)
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.1), hf.down_proj.normal_(0, 0.1)
    op = KTransformersExperts("m.experts", prefixed("m.experts", hf), config, hf,
                              prefill_op="KExpertsCPU", generate_op="KExpertsCPU")
    op.context = RunContext(cpu_threads=2)
    op.load()
    x, w = torch.randn(2, 256), torch.rand(2, 3)
    assert rel_err(op(x, torch.tensor([[0, 1, 4], [2, 3, 1]]), w), hf(x, torch.tensor([[0, 1, 4], [2, 3, 1]]), w)) < 1e-5
    with pytest.raises(ValueError, match=r"expert id 5 .* outside \[0, 5\)"):
        op(x, torch.tensor([[0, 1, 5], [2, 3, 1]]), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 256)])
def test_rmsnorm_operator_matches_transformers(dtype, shape):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from ktransformers.operators.layernorm import KRMSNorm
    hidden = shape[-1]
    hf = Qwen3MoeRMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden) * 0.3 + 1)

    class Weights:
        def load(self, name, device, dtype, shape):
            assert name == "model.norm.weight"
            return hf.weight.detach().to(device, dtype).reshape(shape)
    op = KRMSNorm("model.norm", Weights(), None, hf)
    op.load()
    x = (torch.randn(shape) * 3).to(dtype)
    want, got = hf(x), op(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 256)])
def test_zero_centred_rmsnorm_matches_transformers(family, dtype, shape):
    """KRMSNorm with zero_centred (Qwen3-Next / Qwen3.5: scale 1 + w, one rounding of the float32
    product) against transformers' own norm: equal in float32 up to a sum's order, and bit for
    bit in bf16 on the torch path; the plain option (1 x w) does not match it."""
    import importlib

    from ktransformers.operators.layernorm import KRMSNorm
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = m.Qwen3NextRMSNorm if family == "qwen3_next" else m.Qwen3_5MoeRMSNorm
    hidden = shape[-1]
    hf = cls(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden) * 0.3)

    class Weights:
        def load(self, name, device, dtype, shape):
            return hf.weight.detach().to(device, dtype).reshape(shape)
    x = (torch.randn(shape) * 3).to(dtype)
    want = hf(x)
    for zero_centred in (True, False):
        op = KRMSNorm("model.norm", Weights(), None, hf, zero_centred=zero_centred)
        op.load()
        got = op(x)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        if not zero_centred:
            assert err > 0.1
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.bfloat16 and op.path(x) == "torch":
            assert torch.equal(got, want)
        assert err < (1e-6 if dtype == torch.float32 else 1e-2)


def test_moe_block_waits_for_started_experts_when_shared_experts_fail():
    """A CPU call the block started is waited for even when the shared experts raise (on a GPU
    stream an unwaited doorbell call would leave its `done` word set for the next step's wait)."""
    from ktransformers.operators.moe import KMoEBlock
    events = []

    class Gate(torch.nn.Module):
        def forward(self, x):
            return x, torch.ones(x.shape[0], 2), torch.zeros(x.shape[0], 2, dtype=torch.long)

    class Experts(torch.nn.Module):
        def submit(self, x, ids, weights):
            events.append("submit")
            return lambda: events.append("wait") or torch.zeros_like(x)

    class Shared(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("CUDA out of memory (simulated)")

    block = KMoEBlock.__new__(KMoEBlock)
    torch.nn.Module.__init__(block)
    block.gate, block.experts, block.shared_experts = Gate(), Experts(), Shared()
    with pytest.raises(RuntimeError, match="out of memory"):
        block(torch.randn(1, 3, 8))
    assert events == ["submit", "wait"]


def test_expert_groups_and_layerwise_gpu_bytes():
    """Layer-wise prefill's groups: every expert once, in order, each group's bf16 within the
    budget (one expert at least); the GPU holds one group in bf16 and two groups' stored bytes."""
    from ktransformers.operators.experts import LayerwisePrefill, expert_groups
    assert expert_groups(128, 3 * 2048 * 768 * 2, 2 << 30) == [(0, 128)]  # a Qwen3-30B-A3B layer: one group
    per = 3 * 7168 * 2048 * 2  # a DeepSeek-V3 expert in bf16 (88 MB)
    groups = expert_groups(256, per, 2 << 30)
    assert groups[0] == (0, 24) and groups[-1] == (240, 256) and len(groups) == 11
    assert [e for a, b in groups for e in range(a, b)] == list(range(256))
    assert expert_groups(4, 10, 5) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # an expert over the budget: alone
    stored = 256 * 25_000_000
    assert LayerwisePrefill.gpu_bytes(256, per, stored) == 24 * per + 24 * per  # the next group: bf16 is larger
    assert LayerwisePrefill.gpu_bytes(8, 10, 800) == 80 + 2 * 800  # (its stored bytes larger: counted twice)
