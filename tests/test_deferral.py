"""Expert deferral (n_deferred_experts): each decode token's lowest-weight experts of one MoE layer
join the next MoE layer's output. The C++ kernels against plain torch (moe_reference on masked
weights), and a tiny model's decode through the engine against transformers' model run with the
same deferral as forward hooks."""
import zlib

import pytest
import torch

from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, MoEKernel, supported_isas
from ktransformers.operators.experts import moe_reference
from ktransformers.weights.ggml_quants import GGMLType, dequantize, quantize

E, H, I = 32, 256, 256


@pytest.fixture(scope="module", params=supported_isas())
def runtime(request):
    return CPURuntime(threads=2, isa=request.param)


def bf16_experts(gen):
    """(kernel weights, dequantized) of gate, up and down in BF16."""
    out = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        raw = quantize(torch.randn(E, rows, cols, generator=gen) * 0.05, GGMLType.BF16)
        out.append((ExpertWeights(raw, int(GGMLType.BF16)), dequantize(raw, GGMLType.BF16, (E, rows, cols))))
    return out


def kept_now(ids: torch.Tensor, w: torch.Tensor, defer: int) -> torch.Tensor:
    """[T, K] bool: the pairs computed in the layer's own call. Each token keeps all but the
    `defer` lowest weights of its pairs that are not -1 (computed elsewhere, which are neither)
    (ties: the earlier slot stays); an expert kept by any token of the call is kept for every token."""
    T, K = ids.shape
    kept_experts = set()
    for t in range(T):
        order = sorted((k for k in range(K) if ids[t, k] >= 0), key=lambda k: (-w[t, k].item(), k))
        kept_experts.update(int(ids[t, k]) for k in order[:len(order) - defer])
    return torch.tensor([[int(e) in kept_experts for e in row] for row in ids.tolist()])


def rel_err(a, b):
    """|a - b| / |b|, and |a| where b is all zeros (a layer whose experts were all left out)."""
    diff, scale = (a.float() - b.float()).norm().item(), b.float().norm().item()
    return diff / scale if scale else diff


def reference(x, ids, w, layer):
    (_, gd), (_, ud), (_, dd) = layer
    valid = ids >= 0
    return moe_reference(x, ids.clamp(min=0), w * valid, torch.cat([gd, ud], dim=1), dd)


@pytest.mark.parametrize("K,defer", [(4, 1), (4, 2), (3, 2)])
def test_kernel_defers_the_lowest_weights_to_the_next_layer(runtime, K, defer):
    gen = torch.Generator().manual_seed(zlib.crc32(f"defer{K}{defer}".encode()))
    layers = [bf16_experts(gen) for _ in range(2)]
    a, b = (MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=32)
            for (g, _), (u, _), (d, _) in layers)
    a.set_deferral(defer, b)
    for T in (1, 3, 17):
        for call in ("forward", "submit"):
            xa, xb = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            wa, wb = torch.rand(T, K, generator=gen), torch.rand(T, K, generator=gen)
            ids[0, wa[0].argmax()] = -1  # a pair computed elsewhere (a hot expert on the GPU)
            if T > 1:  # the lowest weight elsewhere (the bus share): the deferred pairs are the CPU's lowest
                ids[1, wa[1].argmin()] = -1
            now = kept_now(ids, wa, defer)
            if T == 1:  # (with more tokens, other tokens may keep the experts token 0 leaves out)
                assert (~now & (ids >= 0)).any()

            a.set_deferring(True)
            if call == "forward":
                ya, yb = a.forward(xa, ids, wa), b.forward(xb, ids, wb)
            else:
                ya = a.submit(xa, ids, wa)
                runtime.sync()
                yb = b.submit(xb, ids, wb)
                runtime.sync()
            later = reference(xa, ids, wa * ~now, layers[0])
            assert rel_err(ya, reference(xa, ids, wa * now, layers[0])) < 1e-2, (T, call)
            assert rel_err(yb, reference(xb, ids, wb, layers[1]) + later) < 1e-2, (T, call)

            a.set_deferring(False)  # prefill: everything now, and no carry for b
            full = a.forward(xa, ids, wa)
            assert rel_err(full, reference(xa, ids, wa, layers[0])) < 1e-2
            assert rel_err(b.forward(xb, ids, wb), reference(xb, ids, wb, layers[1])) < 1e-2


def test_kernel_split_adds_up_to_the_whole(runtime):
    """Layer a's own part plus what it hands to b is a's output without deferral (to float32
    rounding): nothing is lost or counted twice."""
    gen = torch.Generator().manual_seed(7)
    K, T = 4, 5
    layers = [bf16_experts(gen) for _ in range(2)]
    a, b = (MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
            for (g, _), (u, _), (d, _) in layers)
    x, xb = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w, wb = torch.rand(T, K, generator=gen), torch.rand(T, K, generator=gen)
    whole = a.forward(x, ids, w)
    b_alone = b.forward(xb, ids, wb)
    a.set_deferral(2, b)
    a.set_deferring(True)
    part = a.forward(x, ids, w)
    handed = b.forward(xb, ids, wb) - b_alone
    assert rel_err(part, whole) > 1e-3  # something was left out
    assert rel_err(part + handed, whole) < 1e-5


def test_kernel_deferral_checks(runtime):
    gen = torch.Generator().manual_seed(3)
    (g, _), (u, _), (d, _) = bf16_experts(gen)
    a, b = (MoEKernel(runtime, experts=E, top_k=4, hidden=H, intermediate=I, gate=g, up=u, down=d) for _ in range(2))
    with pytest.raises(ValueError, match=r"\[0, top_k - 1 = 3\]"):
        a.set_deferral(4, b)
    with pytest.raises(ValueError, match="next layer"):
        a.set_deferral(1, None)
    with pytest.raises(ValueError, match="next layer"):
        a._moe.set_deferral(1, a._moe)
    a.set_deferral(1, b)
    a.set_deferring(True)
    ids = torch.stack([torch.randperm(E, generator=gen)[:4] for _ in range(3)])
    a.forward(torch.randn(3, H, generator=gen), ids, torch.rand(3, 4, generator=gen))
    with pytest.raises(ValueError, match="deferred experts of 3 tokens, this call has 2"):
        b.forward(torch.randn(2, H, generator=gen), ids[:2], torch.rand(2, 4, generator=gen))


def defer_like_the_kernels(reference, defer: int, decode_from: int) -> None:
    """Make transformers' model `reference` (run on one sequence, without a cache) defer as the
    engine's decode steps do: at positions from `decode_from` on, each MoE layer but the last
    computes a token's experts except its `defer` lowest-weight ones, which are added to the next
    MoE layer's output; earlier positions (the prefill) defer nothing."""
    layers = [m for name, m in reference.named_modules() if name.endswith("mlp.experts")]
    carry = {}

    def wrap(module, inner, last: bool):
        def forward(x, top_k_index, top_k_weights):
            decode = torch.arange(x.shape[0]) >= decode_from
            keep = torch.ones_like(top_k_weights, dtype=torch.bool)
            if not last:
                K = top_k_weights.shape[1]
                order = torch.sort(-top_k_weights, dim=1, stable=True).indices  # ties: the earlier slot first
                lowest = torch.zeros_like(keep).scatter_(1, order[:, K - defer:], True)
                keep = ~(lowest & decode[:, None])
            y = inner(x, top_k_index, top_k_weights * keep)
            if module in carry:
                y = y + carry.pop(module)
            if not last:
                carry[layers[layers.index(module) + 1]] = inner(x, top_k_index, top_k_weights * ~keep)
            return y
        return forward

    for i, module in enumerate(layers):
        module.forward = wrap(module, module.forward, i == len(layers) - 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_decode_with_deferral_matches_transformers_deferring(tmp_path, family):
    """The engine's decode with n_deferred_experts=1 (CPU rule file, C++ kernels) against
    transformers' model deferring the same way in plain torch; the deferral's effect on the
    logits is far larger than the agreement, and its KL from no deferral stays small."""
    from tiny import RULES, reference_state_dict, round_like_cpu_kernels, tiny_model, with_experts_kwargs
    from transformers import AutoModelForCausalLM

    from ktransformers import optimize_and_load_gguf
    from ktransformers.engine.generate import Engine
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.operators.experts import set_expert_deferral
    from ktransformers.weights.gguf_write import write_gguf

    model = tiny_model(family, layers=3)
    types = write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=GGMLType.BF16)
    rules = with_experts_kwargs(RULES_DIR / RULES[family], tmp_path, n_deferred_experts=1)
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, rules, tmp_path / "m.gguf", model.config)
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(11)).tolist()
    prompt = 6

    def decode_logits():
        engine = Engine(ours, cache_lens=32, page_size=4)
        seq = engine.new_sequence()
        engine.prefill(seq, ids[:prompt])
        return torch.stack([engine.decode(seq, t)[0] for t in ids[prompt:-1]])

    def reference(defer):
        ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
        ref.load_state_dict(reference_state_dict(model, types))
        round_like_cpu_kernels(ref, types)
        if defer:
            defer_like_the_kernels(ref, defer, prompt)
        with torch.no_grad():
            return ref(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits[0, prompt:]

    deferred = decode_logits()
    set_expert_deferral(ours, 0)
    whole = decode_logits()
    want_deferred, want_whole = reference(1), reference(0)
    # bf16 activations as the kernels round them: a flip of one rounding step now and then (seen: 2.5e-3, 3.5e-3)
    assert rel_err(whole, want_whole) < 8e-3
    assert rel_err(deferred, want_deferred) < 8e-3
    effect = rel_err(deferred, whole)
    assert effect > 10 * rel_err(deferred, want_deferred), effect
    kl = torch.nn.functional.kl_div(deferred.log_softmax(-1), whole.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert kl.mean() < 1e-2, kl  # (the bound docs/rules.md states for these tiny models)


def test_rule_option_checks(tmp_path):
    from tiny import RULES, reference_rules, tiny_model, with_experts_kwargs

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.weights.gguf_write import write_gguf
    model = tiny_model("qwen3_moe", layers=2)  # top-k 2
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=GGMLType.Q8_0)
    cases = [(with_experts_kwargs(RULES_DIR / RULES["qwen3_moe"], tmp_path, n_deferred_experts=2), r"top-k - 1 \(1\)"),
             (with_experts_kwargs(reference_rules("qwen3_moe", tmp_path), tmp_path, n_deferred_experts=1),
              "needs generate_op KExpertsCPU")]
    for rules, message in cases:
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts.*n_deferred_experts=.*" + message):
            optimize_and_load_gguf(build_skeleton(model.config, torch.float32), rules, tmp_path / "m.gguf",
                                   model.config)
