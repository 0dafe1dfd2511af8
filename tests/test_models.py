"""Model-level parity: tiny random models of each family, written to GGUF in several types and
loaded through the shipped CPU rule files, give transformers' logits on the same weights."""
import warnings

import pytest
import torch
from tiny import (
    FAMILIES,
    HYBRID,
    RULES,
    reference_rules,
    reference_state_dict,
    round_like_cpu_kernels,
    tiny_config,
    tiny_model,
    train_tokenizer,
    with_experts_kwargs,
)
from transformers import AutoModelForCausalLM

from ktransformers import load_model, optimize_and_load_gguf
from ktransformers.kernels.cpu import supported_isas
from ktransformers.loader import RULES_DIR, build_skeleton, load_config, load_tokenizer
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import (
    converter_type,
    tokenizer_metadata,
    write_gguf,
)
from ktransformers.weights.source import WeightError

TOL = 1e-4
TOL_INT8 = 1e-2
TOL_BF16 = 5e-3  # BF16 weights take bf16 activations: the same flips (a step of 2^-8), and routers' choices they move


def q4_k_m(name: str, shape) -> GGMLType:
    """A mixed-type file like llama-quantize's Q4_K_M: Q6_K for attn_v / ffn_down / output, else Q4_K."""
    if "attn_v" in name or "ffn_down" in name or name == "output.weight":
        return converter_type(GGMLType.Q6_K)(name, shape)
    return converter_type(GGMLType.Q4_K)(name, shape)


def mxfp4_moe(name: str, shape) -> GGMLType:
    """As the published gpt-oss GGUFs: the routed experts MXFP4, the rest BF16."""
    return GGMLType.MXFP4 if name.endswith("_exps.weight") else converter_type(GGMLType.BF16)(name, shape)


TYPES = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16, "Q8_0": GGMLType.Q8_0,
         "Q2_K": GGMLType.Q2_K, "Q3_K": GGMLType.Q3_K, "Q4_K": GGMLType.Q4_K, "Q6_K": GGMLType.Q6_K, "Q4_K_M": q4_k_m,
         "MXFP4_MOE": mxfp4_moe}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def check_parity(family, path, types, model, split_kv_b=True, seq=13, rules=None):
    """Logits of the GGUF loaded through `rules` (default: the shipped CPU file, C++ kernels) against
    transformers on the same dequantized weights, rounding activations as the kernels do."""
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reference.load_state_dict(reference_state_dict(model, types, split_kv_b))
    if rules is None:
        round_like_cpu_kernels(reference, types)
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, rules or RULES_DIR / RULES[family], path, model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    want = logits(reference, ids)
    err = rel_err(logits(ours, ids), want)
    # int8 activations: the reference rounds the same way, but values computed in another order
    # now and then land one rounding step apart, and such flips add up over layers
    quantized = rules is None and any(t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) for t in types.values())
    bf16 = rules is None and GGMLType.BF16 in types.values()
    tol = TOL_INT8 if quantized else TOL_BF16 if bf16 else TOL
    if (quantized or bf16) and err >= tol:
        # where one flip moves the logits past the bound (tiny DeepSeek-V2-Lite with Q2_K/Q6_K's
        # 256-value activation blocks: 1e-2 from one flip), the bound is how far the reference
        # itself moves when its embeddings are jittered by 1e-6: as close to it as it is to itself
        # (bf16 activations round too: the tiny Qwen3-Next, whose DeltaNet norms amplify, needs this)
        spread = _jitter_spread(reference, ids, want)
        # (the tiny hybrid models, whose DeltaNet norms amplify, move up to 8e-2 of themselves)
        assert err < max(tol, 1.5 * spread) and spread < (1e-1 if family in HYBRID else 5e-2), \
            f"{family}: relative error {err:.2e}, the reference's own spread {spread:.2e}"
        return ours
    assert err < tol, f"{family}: relative error {err:.2e}"
    return ours


def _jitter_spread(model, ids, want, trials: int = 5) -> float:
    """The largest relative change of `model`'s logits (want) over `trials` jitters of its
    embedding table by a relative 1e-6."""
    emb = model.get_input_embeddings().weight
    kept = emb.detach().clone()
    spread = 0.0
    try:
        for seed in range(trials):
            noise = torch.randn(kept.shape, generator=torch.Generator().manual_seed(100 + seed))
            with torch.no_grad():
                emb.copy_(kept * (1 + 1e-6 * noise))
            spread = max(spread, rel_err(logits(model, ids), want))
    finally:
        with torch.no_grad():
            emb.copy_(kept)
    return spread


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_transformers(tmp_path, family, type_name):
    model = tiny_model(family)
    path = tmp_path / f"{family}-{type_name}.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=TYPES[type_name])
    if type_name not in ("F32", "F16", "BF16"):
        assert any(t not in (GGMLType.F32,) for t in types.values())
    check_parity(family, path, types, model, rules=reference_rules(family, tmp_path))  # torch reference ops
    check_parity(family, path, types, model)  # C++ kernels


def test_deepseek_old_files_with_attn_kv_b(tmp_path):
    model = tiny_model("deepseek_v3", seed=3)
    path = tmp_path / "old.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0, split_kv_b=False)
    assert "blk.1.attn_kv_b.weight" in types and "blk.1.attn_k_b.weight" not in types
    check_parity("deepseek_v3", path, types, model, split_kv_b=False)


def test_split_files_and_directory(tmp_path):
    model = tiny_model("qwen3_moe", seed=5)
    types = write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=GGMLType.Q8_0, split_max_tensors=10)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) > 3 and files[0] == f"m-00001-of-{len(files):05d}.gguf"
    check_parity("qwen3_moe", tmp_path, types, model)  # the directory
    check_parity("qwen3_moe", tmp_path / files[-1], types, model)  # any one split file finds its siblings


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_gguf_metadata(tmp_path, family):
    model = tiny_model(family)
    path = tmp_path / "m.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.F16)
    config = load_config(None, path)
    assert config.model_type == model.config.model_type
    for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok",
                 "intermediate_size", "rms_norm_eps", "num_key_value_heads"):
        assert getattr(config, attr, None) == pytest.approx(getattr(model.config, attr, None)), attr
    loaded = load_model(path, dtype=torch.float32, progress=False, tokenizer=False)  # config from GGUF, shipped CPU rules
    reference = tiny_model(family, seed=99)
    reference.load_state_dict(reference_state_dict(model, types))
    ids = torch.randint(0, 320, (1, 9))
    assert rel_err(logits(loaded.model, ids), logits(reference, ids)) < TOL


def test_missing_tensor_is_an_error_listing_it(tmp_path):
    model = tiny_model("mixtral")
    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    write_gguf(tmp_path / "m.gguf", model.config, state)
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*blk\.1\.attn_k\.weight"):
        optimize_and_load_gguf(build_skeleton(model.config, torch.float32), RULES_DIR / RULES["mixtral"],
                               tmp_path / "m.gguf", model.config)


def test_extra_tensor_is_an_error_listing_it(tmp_path):
    model = tiny_model("qwen2_moe")
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict())
    fewer = tiny_model("qwen2_moe", layers=2).config  # the file has a third layer the config does not
    with pytest.raises(WeightError, match=r"did not use: .*model\.layers\.2\."):
        optimize_and_load_gguf(build_skeleton(fewer, torch.float32), RULES_DIR / RULES["qwen2_moe"],
                               tmp_path / "m.gguf", fewer)


def test_shape_that_disagrees_with_config(tmp_path):
    model = tiny_model("qwen3_moe")
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict())
    config = tiny_model("qwen3_moe").config
    config.vocab_size = 640
    with pytest.raises((WeightError, ValueError), match=r"token_embd|embed_tokens|lm_head"):
        optimize_and_load_gguf(build_skeleton(config, torch.float32), RULES_DIR / RULES["qwen3_moe"],
                               tmp_path / "m.gguf", config)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_tokenizer_from_gguf_metadata(tmp_path, family):
    tokenizer = train_tokenizer(320)
    model = tiny_model(family, layers=2)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), extra_metadata=tokenizer_metadata(tokenizer))
    config = load_config(None, tmp_path / "m.gguf")
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)
    rebuilt = load_tokenizer(None, tmp_path / "m.gguf")
    if rebuilt is None:  # transformers builds GGUF tokenizers per architecture; older releases lack deepseek2
        assert family == "deepseek_v3", "transformers builds qwen3moe GGUF tokenizers"
        return
    text = "the lazy dog says hello, world!"
    assert rebuilt(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert rebuilt.eos_token == "</s>" and rebuilt.decode(tokenizer(text)["input_ids"]) == text


def test_one_dimensional_shared_expert_gate(tmp_path):
    """llama-quantize writes Qwen2-MoE's [1, H] shared_expert_gate as a 1-D [H] tensor."""
    model = tiny_model("qwen2_moe", layers=1)
    state = {k: (v.reshape(-1) if k.endswith("shared_expert_gate.weight") else v) for k, v in model.state_dict().items()}
    types = write_gguf(tmp_path / "m.gguf", model.config, state)
    check_parity("qwen2_moe", tmp_path / "m.gguf", types, model)


def _with_next_n_layer(model) -> dict[str, torch.Tensor]:
    """The state dict as GLM-4.5's checkpoints and GGUFs carry it: one more (next-n, MTP) layer
    after the last, with its own projections and norms besides a whole decoder layer's tensors."""
    n, state = model.config.num_hidden_layers, dict(model.state_dict())
    last = f"model.layers.{n - 1}."
    state |= {k.replace(last, f"model.layers.{n}."): torch.randn_like(v) for k, v in model.state_dict().items()
              if k.startswith(last)}
    H = model.config.hidden_size
    state |= {f"model.layers.{n}.eh_proj.weight": torch.randn(H, 2 * H), f"model.layers.{n}.enorm.weight": torch.ones(H),
              f"model.layers.{n}.hnorm.weight": torch.ones(H), f"model.layers.{n}.shared_head.norm.weight": torch.ones(H)}
    return state


def test_glm4moe_next_n_layer_is_recognised_and_left_unread(tmp_path):
    """A GLM-4.5 GGUF counts its MTP layer in block_count (glm4moe.nextn_predict_layers says how
    many): the config built from the file has the main layers only, the MTP layer's tensors are no
    error, and the logits are those of the main layers; a layer past the MTP ones still is an error."""
    from ktransformers.weights.gguf import GGUFFileSet
    model = tiny_model("glm4_moe")
    model.config.num_nextn_predict_layers = 1
    path = tmp_path / "glm.gguf"
    types = write_gguf(path, model.config, _with_next_n_layer(model), types=GGMLType.Q8_0)
    n = model.config.num_hidden_layers
    meta = GGUFFileSet(path).metadata
    assert (meta["glm4moe.block_count"], meta["glm4moe.nextn_predict_layers"]) == (n + 1, 1)
    assert "blk.3.nextn.eh_proj.weight" in types and "blk.3.ffn_gate_exps.weight" in types
    config = load_config(None, path)
    assert (config.num_hidden_layers, config.num_nextn_predict_layers) == (n, 1)
    loaded = load_model(path, dtype=torch.float32, progress=False, tokenizer=False)
    reference = tiny_model("glm4_moe", seed=99)
    reference.load_state_dict(reference_state_dict(model, types))
    round_like_cpu_kernels(reference, types)
    ids = torch.randint(0, 320, (1, 9))
    assert rel_err(logits(loaded.model, ids), logits(reference, ids)) < TOL_INT8
    config.num_nextn_predict_layers = 0  # the same file, read as if it had no MTP layer
    with pytest.raises(WeightError, match=r"did not use: .*model\.layers\.3\."):
        optimize_and_load_gguf(build_skeleton(config, torch.float32), RULES_DIR / RULES["glm4_moe"], path, config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_rule_without_cuda_names_the_rule(tmp_path):
    model = tiny_model("mixtral", layers=1)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict())
    rules = tmp_path / "gpu.yaml"
    rules.write_text("- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear, kwargs: {generate_device: cuda}}\n")
    with pytest.raises(ValueError, match=r"rule 0 puts 'lm_head' on cuda \(generate_device\).*-cpu rule file"):
        optimize_and_load_gguf(build_skeleton(model.config, torch.float32), rules, tmp_path / "m.gguf", model.config)


@pytest.mark.parametrize("isa", supported_isas())
def test_int8_prefill_option(tmp_path, monkeypatch, isa):
    """KExpertsCPU with int8_prefill keeps int8 copies where the int8 GEMM runs on VNNI; a long
    prompt goes through them. At the AVX2 level, whose GEMM is slower than the stored blocks' own
    kernels, the option is off with a warning and the blocks compute (the same logits)."""
    from ktransformers.kernels.cpu import load_extension
    monkeypatch.setenv("KT_CPU_ISA", isa)
    vnni = load_extension(isa).int8_gemm_vnni
    model = tiny_model("qwen3_moe")
    path = tmp_path / "m.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q4_K)
    rules = tmp_path / "int8.yaml"
    rules.write_text((RULES_DIR / RULES["qwen3_moe"]).read_text().replace("out_device: cpu", "out_device: cpu\n      int8_prefill: true"))
    ours = build_skeleton(model.config, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimize_and_load_gguf(ours, rules, path, model.config)
    experts = ours.model.layers[0].mlp.experts.ops["prefill"]
    assert experts.kernel.runtime.isa == isa
    off = [w for w in caught if "int8_prefill is off" in str(w.message)]
    assert (experts.kernel.int8_min_tokens > 0, bool(off)) == (vnni, not vnni), [str(w.message) for w in off]
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reference.load_state_dict(reference_state_dict(model, types))
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(1))
    assert rel_err(logits(ours, ids), logits(reference, ids)) < 5e-2



@pytest.mark.parametrize("source, option", [("gguf-q8_0", "int4_prefill"), ("safetensors-fp8", "int4_prefill"),
                                            ("safetensors-fp8", "int4_decode")])
def test_int4_prefill_option(tmp_path, source, option):
    """KExpertsCPU with int4_prefill converts the experts at load (from GGUF blocks, or from an FP8
    checkpoint) to int4 copies in groups of int4_group; a long prompt goes through them: its logits
    are those of transformers with the experts' weights rounded to int4 the same way. With
    int4_decode the copies are the only weights: short inputs (decode-sized calls) too."""
    from ktransformers.kernels.cpu import Int4Rows, load_extension
    if not load_extension().int4_gemm:
        pytest.skip("the CPU kernels here have no int4 GEMM (needs AVX512-VNNI)")
    family = "qwen3_moe" if source.startswith("gguf") else "deepseek_v3"
    model = tiny_model(family)
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    if source.startswith("gguf"):
        path = tmp_path / "m.gguf"
        types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0)
        reference.load_state_dict(reference_state_dict(model, types))
    else:
        from safetensors.torch import save_file
        from test_safetensors import write_fp8_checkpoint
        path, ref_dir = tmp_path / "ckpt", tmp_path / "ref"
        path.mkdir()
        dequantized = write_fp8_checkpoint(model, path)
        ref_dir.mkdir()
        save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})
        (ref_dir / "config.json").write_text((path / "config.json").read_text())
        reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    text = (RULES_DIR / RULES[family]).read_text()
    rules = tmp_path / "int4.yaml"
    rules.write_text(text.replace("out_device: cpu", f"out_device: cpu\n      {option}: true\n      int4_group: 128"))
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, rules, path, model.config)
    layer = next(m for m in ours.model.layers if hasattr(m.mlp, "experts"))
    kernel = layer.mlp.experts.ops["prefill"].kernel
    assert kernel.int8_min_tokens > 0 and kernel._int4[0].group == 128
    assert kernel.copies_only == (option == "int4_decode")
    prompts = [torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(1)) for n in (64, 3)]
    got = [logits(ours, ids) for ids in prompts]
    before = logits(reference, prompts[0])
    with torch.no_grad():  # the reference's routed experts through the same int4 rounding, in torch
        for name, p in reference.named_parameters():
            if ".experts." in name:
                p.copy_(Int4Rows.from_dense(p.detach(), 128).dequantized())
    # (routing in these tiny random models flips with small changes: the int4 weights move the
    # logits by 0.05-0.15, the same weights in the reference leave only the activations' rounding)
    assert rel_err(got[0], logits(reference, prompts[0])) < 0.03 < rel_err(got[0], before)
    if option == "int4_decode":  # 3 tokens: under the copies' threshold, yet through them
        assert rel_err(got[1], logits(reference, prompts[1])) < 0.03

    for group in (96, 0):  # (0: the memory plan must not fail first)
        rules.write_text(text.replace("out_device: cpu", f"out_device: cpu\n      {option}: true\n      int4_group: {group}"))
        with pytest.raises(ValueError, match="int4_group must be a multiple of 64"):
            load_model(path, None if source.startswith("gguf") else path, rules, tokenizer=False, progress=False)


def test_pcie_share_refused_for_gpt_oss_experts(tmp_path):
    """The PCIe share's kernels have no biases or clamped SwiGLU: asking for it on gpt-oss's
    experts is an error naming the option, not silently wrong logits."""
    model = tiny_model("gpt_oss", layers=1)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=GGMLType.Q8_0)
    rules = with_experts_kwargs(RULES_DIR / RULES["gpt_oss"], tmp_path, pcie_experts=2)
    with pytest.raises(ValueError, match="pcie_experts=2.*biases or the clamped SwiGLU"):
        optimize_and_load_gguf(build_skeleton(model.config, torch.float32), rules, tmp_path / "m.gguf", model.config)


def _regex_pieces(text: str, patterns) -> list[str]:
    """The pieces llama.cpp's pre-tokenizer makes: each pattern in turn splits every piece into its
    matches and the text between them (Python's `regex` module: an independent engine)."""
    import regex
    pieces = [text]
    for pattern in patterns:
        out = []
        flags = regex.V1 if "&&" in pattern else 0  # (set intersection: Kimi-K2's pattern)
        for piece in pieces:
            at = 0
            for m in regex.finditer(pattern, piece, flags=flags):
                if m.start() > at:
                    out.append(piece[at:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", ["deepseek-v3", "deepseek-llm", "glm4", "kimi-k2", "minimax-m2"])
def test_tokenizer_from_gguf_splits_as_llama_cpp(tmp_path, pre):
    """GGUF pre-tokenizers transformers' builder does not know get llama.cpp's split: digits in
    runs of three (DeepSeek-V2's: a whole run, apart from its space), CJK and punctuation runs apart
    (GPT-2's split would keep " 12345" whole)."""
    from ktransformers.weights.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    model = tiny_model("deepseek_v3", layers=1)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(),
               extra_metadata=tokenizer_metadata(train_tokenizer(320), pre=pre))
    rebuilt = load_tokenizer(None, tmp_path / "m.gguf")
    text = "The year 12345, I'LL say: 你好世界!\n\n  ok?? (x+y)=2 WORLD日本語 café"
    got = [text[a:b] for _, (a, b) in rebuilt.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert got == _regex_pieces(text, PRE_TOKENIZER_SPLITS[pre])
    assert "12345" in got if pre == "deepseek-llm" else "123" in got and "45" in got


def test_kimi_k2_shape_through_the_deepseek_v3_rules(tmp_path):
    """Kimi-K2 is DeepSeek-V3's architecture with one expert group (and its own pre-tokenizer): a
    file of that shape loads with nothing but the GGUF (config, tokenizer, the DeepSeek-V3 CPU rules)."""
    config = tiny_config("deepseek_v3")
    config.n_group, config.topk_group, config.n_routed_experts = 1, 1, 12
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if name.endswith("norm.weight") else 0))
    types = write_gguf(tmp_path / "k2.gguf", model.config, model.state_dict(), types=GGMLType.F16,
                       extra_metadata=tokenizer_metadata(train_tokenizer(320), pre="kimi-k2"))
    loaded = load_model(tmp_path / "k2.gguf", dtype=torch.float32, progress=False)
    assert (loaded.config.n_group, loaded.config.n_routed_experts) == (1, 12)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.load_state_dict(reference_state_dict(model, types))
    ids = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(2))
    assert rel_err(logits(loaded.model, ids), logits(reference, ids)) < TOL
    text = "WORLD日本語 12345"
    pieces = [text[a:b] for _, (a, b) in loaded.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == ["WORLD", "日本語", " ", "123", "45"]  # Han apart from other letters, digits in threes
