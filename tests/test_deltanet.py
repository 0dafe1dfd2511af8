"""The C++ gated delta rule (csrc/deltanet.cpp, the recurrence of Qwen3-Next's and Qwen3.5-MoE's
gated-DeltaNet layers) against transformers' own torch path, torch_recurrent_gated_delta_rule,
on fresh random inputs and states: several head groupings, token counts and batch sizes, with
and without the L2 norm of q and k, at every ISA level this CPU runs; a state carried across
calls equals one call over all the tokens; bad inputs are ValueErrors naming the tensor."""
import pytest
import torch

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from ktransformers.kernels.cpu import CPURuntime, gated_delta_rule, supported_isas  # noqa: E402


@pytest.fixture(scope="module", params=supported_isas())
def runtime(request):
    return CPURuntime(threads=2, isa=request.param)


def inputs(B, T, Hk, Hv, Dk, Dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, Dk, generator=gen) for _ in range(2))
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen) * 2  # log-decays: the state shrinks by exp(g) a token
    beta = torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, Dk, Dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state, l2norm):
    out, final = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                             output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return out, final


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 16), (2, 7, 2, 4, 32, 16), (3, 33, 1, 3, 64, 48),
                                   (1, 5, 4, 8, 128, 128)], ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s))
@pytest.mark.parametrize("l2norm", [True, False])
def test_matches_transformers(runtime, shape, l2norm):
    q, k, v, g, beta, state = inputs(*shape, seed=sum(shape) + l2norm)
    want, want_state = reference(q, k, v, g, beta, state, l2norm)
    got_state = state.clone()
    got = gated_delta_rule(runtime, q, k, v, g, beta, got_state, l2norm)
    # (float32 both, summed in other orders: ~1e-5 where q and k are not normalized and Dk is 128)
    assert rel_err(got, want) < 5e-5, runtime.isa
    assert rel_err(got_state, want_state) < 5e-5
    assert not torch.equal(got_state, state)  # (the state was updated in place)


def test_a_carried_state_equals_one_call(runtime):
    """Prefill in two parts, then decode token by token, carrying the state: the outputs of one
    call over every token (what the engine's chunks and decode steps rely on)."""
    q, k, v, g, beta, state = inputs(2, 12, 2, 4, 32, 32, seed=5)
    whole_state = state.clone()
    whole = gated_delta_rule(runtime, q, k, v, g, beta, whole_state)
    parts, carried = [], state.clone()
    for a, b in ((0, 5), (5, 9), (9, 10), (10, 11), (11, 12)):
        parts.append(gated_delta_rule(runtime, *(t[:, a:b].contiguous() for t in (q, k, v, g, beta)), carried))
    assert rel_err(torch.cat(parts, dim=1), whole) < 1e-6 and rel_err(carried, whole_state) < 1e-6


def test_bad_inputs_name_the_tensor(runtime):
    q, k, v, g, beta, state = inputs(1, 3, 2, 4, 16, 16, seed=1)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(runtime, q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], state[:, :3])
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule(runtime, q, k, v, g, beta, state[:, :, :8])
    with pytest.raises(ValueError, match="beta must be a contiguous float32"):
        gated_delta_rule(runtime, q, k, v, g, beta.double(), state)
    with pytest.raises(ValueError, match="v must be a contiguous"):
        gated_delta_rule(runtime, q, k, v.transpose(2, 3).contiguous().transpose(2, 3), g, beta, state)
