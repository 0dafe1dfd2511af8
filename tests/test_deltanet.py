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
    r = v.shape[2] // q.shape[2]  # key heads repeated for their value heads first, as the model does
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # (transformers 5.17's function needs it)
    out, final = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                             output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return out, final


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 16), (2, 7, 2, 4, 32, 16), (3, 33, 1, 3, 64, 48),
                                   (1, 5, 4, 8, 128, 128),
                                   (1, 64, 1, 2, 128, 128), (2, 150, 2, 4, 32, 16), (1, 200, 2, 2, 64, 64)],
                         ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s))
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


@pytest.mark.parametrize("T, cuts", [(12, (0, 5, 9, 10, 11, 12)), (200, (0, 70, 150, 190, 199, 200))],
                         ids=["short", "long"])
def test_a_carried_state_equals_one_call(runtime, T, cuts):
    """Prefill in parts, then decode token by token, carrying the state: the outputs of one call
    over every token (what the engine's chunks and decode steps rely on)."""
    q, k, v, g, beta, state = inputs(2, T, 2, 4, 32, 32, seed=5)
    whole_state = state.clone()
    whole = gated_delta_rule(runtime, q, k, v, g, beta, whole_state)
    parts, carried = [], state.clone()
    for a, b in zip(cuts, cuts[1:]):
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


@pytest.mark.parametrize("shape", [(1, 1, 2, 2, 16, 16), (3, 1, 2, 4, 32, 16), (2, 9, 1, 3, 64, 48)],
                         ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s))
def test_rows_of_a_state_table_match_transformers(runtime, shape):
    """gated_delta_rule_rows (the hybrid cache's ring of states): each sequence reads one row (or
    zeros, row -1) and writes another, or the same; rows not written stay as they were."""
    from ktransformers.kernels.cpu import gated_delta_rule_rows
    B, T, Hk, Hv, Dk, Dv = shape
    q, k, v, g, beta, _ = inputs(*shape, seed=sum(shape))
    table = torch.randn(2 * B + 1, Hv, Dk, Dv, generator=torch.Generator().manual_seed(7)) * 0.1
    rows_in = torch.tensor([-1] + [2 * b for b in range(1, B)])  # the first starts from zeros
    rows_out = torch.tensor([2 * b + 1 for b in range(B)])
    if B > 1:
        rows_out[-1] = rows_in[-1]  # the last one in place
    start = torch.stack([torch.zeros(Hv, Dk, Dv) if r < 0 else table[r] for r in rows_in.tolist()])
    want, want_state = reference(q, k, v, g, beta, start, True)
    got_table = table.clone()
    got = gated_delta_rule_rows(runtime, q, k, v, g, beta, got_table, rows_in, rows_out)
    assert rel_err(got, want) < 5e-5
    assert rel_err(got_table[rows_out], want_state) < 5e-5
    untouched = [r for r in range(table.shape[0]) if r not in rows_out.tolist()]
    assert torch.equal(got_table[untouched], table[untouched])


def test_rows_out_of_the_table_are_refused(runtime):
    from ktransformers.kernels.cpu import gated_delta_rule_rows
    q, k, v, g, beta, _ = inputs(2, 1, 1, 2, 16, 16, seed=3)
    table = torch.zeros(4, 2, 16, 16)
    with pytest.raises(IndexError, match="reads state row 4 and writes row 1 of 4"):
        gated_delta_rule_rows(runtime, q, k, v, g, beta, table, torch.tensor([0, 4]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="two sequences write state row 2"):
        gated_delta_rule_rows(runtime, q, k, v, g, beta, table, torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="rows_in must be a contiguous int64"):
        gated_delta_rule_rows(runtime, q, k, v, g, beta, table, torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([2, 3]))


# -- the one-call decode kernels from the projections: C++ (kernels.cpu) and Triton (kernels.triton.deltanet) --

def projections_reference(projections, heads, tiled):
    """(mixed [n, C], z [n, Hv, Dv], b, a [n, Hv]) from the layer's projections: Qwen3-Next's fused
    pair split by transformers' own fix_query_key_value_ordering, Qwen3.5's four as they are."""
    from types import SimpleNamespace
    Hk, Hv, Dk, Dv = heads
    if len(projections) == 4:
        qkv, z, b, a = projections
        return qkv, z.reshape(-1, Hv, Dv), b, a
    qkvz, ba = projections
    layout = SimpleNamespace(num_k_heads=Hk, num_v_heads=Hv, head_k_dim=Dk, head_v_dim=Dv)
    q, k, v, z, b, a = qwen3_next.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(layout, qkvz[None], ba[None])
    n = qkvz.shape[0]
    return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1), z[0], b[0], a[0]


def decode_reference(projections, conv_w, conv_states, ssm_states, neg_a, dt_bias, norm, heads, tiled):
    """One token through the layer's torch ops, rounded where they round (the conv output and the
    delta rule's output to the projections' dtype): transformers' delta rule and gated norm."""
    Hk, Hv, Dk, Dv = heads
    mixed, z, b, a = projections_reference(projections, heads, tiled)
    n, dtype = mixed.shape[0], mixed.dtype
    window = torch.cat([conv_states, mixed.float()[:, :, None]], dim=2)
    x = torch.nn.functional.silu((window * conv_w[None]).sum(-1)).to(dtype)
    q, k, v = torch.split(x, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(n, 1, Hk, Dk), k.reshape(n, 1, Hk, Dk), v.reshape(n, 1, Hv, Dv)
    if tiled:
        q, k = q.repeat(1, 1, Hv // Hk, 1), k.repeat(1, 1, Hv // Hk, 1)
    else:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    beta = b.float().sigmoid()
    g = neg_a * torch.nn.functional.softplus(a.float() + dt_bias)
    out, state = qwen3_next.torch_recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g[:, None], beta[:, None],
                                                             initial_state=ssm_states.clone(), output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    normed = norm(out[:, 0].to(dtype).reshape(-1, Dv), z.reshape(-1, Dv))
    return normed.reshape(n, Hv * Dv), window[:, :, 1:], state


def decode_case(shape, fused, tiled, dtype, device, seed):
    n, Hk, Hv, Dk, Dv, K = shape
    R, C, rows = Hv // Hk, 2 * Hk * Dk + Hv * Dv, 2 * n + 1
    gen = torch.Generator().manual_seed(seed)
    widths = (Hk * (2 * Dk + 2 * R * Dv), 2 * Hv) if fused else (C, Hv * Dv, Hv, Hv)
    projections = tuple(torch.randn(n, w, generator=gen).to(dtype) for w in widths)
    conv_w = 0.5 * torch.randn(C, K, generator=gen)
    conv, ssm = torch.randn(rows, C, K - 1, generator=gen), 0.1 * torch.randn(rows, Hv, Dk, Dv, generator=gen)
    neg_a, dt_bias = -torch.rand(Hv, generator=gen) * 2, torch.randn(Hv, generator=gen)
    norm = qwen3_next.Qwen3NextRMSNormGated(Dv, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(Dv, generator=gen))
    on = lambda *ts: tuple(t.to(device) for t in ts)  # noqa: E731
    return dict(projections=on(*projections), conv=conv.to(device), conv_w=conv_w.to(device), ssm=ssm.to(device),
                neg_a=neg_a.to(device), dt_bias=dt_bias.to(device), norm=norm.to(device), heads=(Hk, Hv, Dk, Dv))


DECODE_SHAPES = [(1, 2, 4, 16, 16, 4), (3, 1, 3, 32, 16, 4), (2, 2, 2, 64, 32, 3), (2, 2, 4, 128, 128, 4)]


def check_decode(decode, shape, layout, dtype, device):
    """A decode kernel from the raw projections (Qwen3-Next's fused pair, Qwen3.5's four in either
    value-head order) over state rows read from one row and written to another, one sequence
    fresh, then in place: the output, the conv states (exact) and the delta states, against
    transformers' pieces; rows no sequence writes stay untouched."""
    fused, tiled = layout == "fused", layout == "tiled"
    case = decode_case(shape, fused, tiled, dtype, device, seed=sum(shape) + len(layout))
    n = shape[0]
    reads = torch.arange(n) * 2
    reads[-1] = -1  # a fresh sequence: zero states
    writes = torch.arange(n) * 2 + 1
    for reads, writes in ((reads, writes), (torch.arange(n) * 2, torch.arange(n) * 2)):  # then in place
        conv, ssm = case["conv"].clone(), case["ssm"].clone()
        fresh = (reads < 0).to(device)
        safe = reads.clamp(min=0).to(device)
        want, want_conv, want_ssm = decode_reference(
            case["projections"], case["conv_w"], conv[safe].masked_fill(fresh[:, None, None], 0),
            ssm[safe].masked_fill(fresh[:, None, None, None], 0), case["neg_a"], case["dt_bias"], case["norm"],
            case["heads"], tiled)
        got = decode(case["projections"], conv, case["conv_w"], ssm, reads.to(device), writes.to(device),
                     case["neg_a"], case["dt_bias"], case["norm"].weight.detach(), 1e-6, case["heads"], tiled)
        assert got.dtype == dtype and got.shape == want.shape
        bound = 5e-5 if dtype == torch.float32 else 2e-2  # bf16: a conv output a rounding step apart moves the rest
        assert rel_err(got.float(), want.detach().float()) < bound
        assert torch.equal(conv[writes], want_conv)  # the raw inputs, as they are
        assert rel_err(ssm[writes], want_ssm) < (5e-5 if dtype == torch.float32 else 2e-2)
        if not torch.equal(reads, writes):
            untouched = torch.ones(conv.shape[0], dtype=torch.bool)
            untouched[writes] = False
            assert torch.equal(ssm[untouched], case["ssm"][untouched]) and torch.equal(conv[untouched],
                                                                                     case["conv"][untouched])


@pytest.mark.parametrize("layout", ["fused", "grouped", "tiled"])
@pytest.mark.parametrize("shape", DECODE_SHAPES + [(2, 1, 2, 8, 24, 4)], ids=lambda s: "n{}Hk{}Hv{}Dk{}Dv{}K{}".format(*s))
def test_cpu_decode_matches_transformers(runtime, shape, layout):
    """The C++ one-call decode (rows written to another row are streamed where Dv fills whole
    vectors: Dv 24 takes the plain stores at AVX-512, the streamed ones at AVX2)."""
    from functools import partial

    from ktransformers.kernels.cpu import gated_delta_decode
    check_decode(partial(gated_delta_decode, runtime), shape, layout, torch.float32, torch.device("cpu"))


def test_cpu_decode_bad_inputs_are_errors(runtime):
    from ktransformers.kernels.cpu import gated_delta_decode
    case = decode_case((2, 1, 2, 16, 16, 4), True, False, torch.float32, torch.device("cpu"), seed=1)
    args = dict(conv=case["conv"][:3].clone(), conv_w=case["conv_w"], ssm=case["ssm"][:3].clone(), neg_a=case["neg_a"],
                dt_bias=case["dt_bias"], norm_w=case["norm"].weight.detach(), eps=1e-6, heads=case["heads"], tiled=False)
    qkvz, ba = case["projections"]

    def call(reads, writes, projections=(qkvz, ba), **changed):
        return gated_delta_decode(runtime, projections, reads=torch.tensor(reads), writes=torch.tensor(writes),
                                  **(args | changed))
    with pytest.raises(IndexError, match="writes row 3 of 3"):
        call([0, 1], [0, 3])
    with pytest.raises(ValueError, match="share conv row 1"):
        call([0, 1], [1, 1])
    with pytest.raises(ValueError, match="share conv row 0"):
        call([0, 0], [2, 0])  # (sequence 0 reads the row sequence 1 writes)
    with pytest.raises(ValueError, match="in_proj_qkvz must be"):
        call([0, 1], [0, 1], projections=(qkvz[:, 1:].contiguous(), ba))
    with pytest.raises(ValueError, match="in_proj_ba must be a contiguous float32"):
        call([0, 1], [0, 1], projections=(qkvz, ba.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="projections are"):
        call([0, 1], [0, 1], projections=(qkvz,))
    with pytest.raises(ValueError, match="ssm must be"):
        call([0, 1], [0, 1], ssm=args["ssm"][:, :1].contiguous())
    assert torch.equal(args["conv"], case["conv"][:3]) and torch.equal(args["ssm"], case["ssm"][:3])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["fused", "grouped", "tiled"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "n{}Hk{}Hv{}Dk{}Dv{}K{}".format(*s))
def test_triton_decode_matches_transformers(shape, layout, dtype):
    """The one-launch Triton decode kernel, on CUDA, else in Triton's interpreter."""
    from tiny import kernel_device

    from ktransformers.kernels.triton.deltanet import gated_delta_decode
    check_decode(gated_delta_decode, shape, layout, dtype, kernel_device())


@pytest.mark.triton
def test_triton_decode_bad_inputs_name_the_tensor():
    from tiny import kernel_device

    from ktransformers.kernels.triton.deltanet import gated_delta_decode
    device = kernel_device()
    case = decode_case((2, 1, 2, 16, 16, 4), True, False, torch.float32, device, seed=1)
    rows = torch.tensor([0, 1], device=device)
    args = dict(conv=case["conv"], conv_w=case["conv_w"], ssm=case["ssm"], reads=rows, writes=rows,
                neg_a=case["neg_a"], dt_bias=case["dt_bias"], norm_w=case["norm"].weight.detach(), eps=1e-6,
                heads=case["heads"], tiled=False)
    qkvz, ba = case["projections"]
    with pytest.raises(ValueError, match="qkvz must be"):
        gated_delta_decode((qkvz[:, 1:], ba), **args)
    with pytest.raises(ValueError, match="ba must be"):
        gated_delta_decode((qkvz, ba.to(torch.bfloat16)), **args)
    with pytest.raises(ValueError, match="ssm must be"):
        gated_delta_decode((qkvz, ba), **{**args, "ssm": case["ssm"][:, :1]})
    with pytest.raises(ValueError, match="reads must be"):
        gated_delta_decode((qkvz, ba), **{**args, "reads": rows.int()})
    # rows past the tables are neither read (zeros) nor written: no store lands outside them
    conv, ssm = case["conv"].clone(), case["ssm"].clone()
    far = torch.tensor([conv.shape[0] + 3, -2], device=device)
    out = gated_delta_decode((qkvz, ba), **{**args, "conv": conv, "ssm": ssm, "reads": far, "writes": far})
    assert torch.equal(conv, case["conv"]) and torch.equal(ssm, case["ssm"]) and torch.isfinite(out).all()
    fresh = gated_delta_decode((qkvz, ba), **{**args, "conv": conv, "ssm": ssm, "reads": torch.full_like(far, -1),
                                                "writes": far})
    assert torch.equal(out, fresh)  # (an unreadable row reads as zero states)
