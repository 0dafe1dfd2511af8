"""What upstream KTransformers' users type keeps working: its flags (renamed ones passed on,
dropped ones noted), its console script form, `--force_think true`, its import path of the
loader, and --model_path as a Hugging Face repo id found in the local cache."""
import subprocess
import sys

import pytest
from test_models import logits, rel_err

from ktransformers.upstream import CHAT_FLAGS, SERVER_FLAGS, SERVER_RENAMES, drop_upstream_flags


def test_upstream_flags_renamed_or_dropped_with_a_note(capsys):
    argv = ["--model_dir", "/m", "--web", "true", "--port", "10002", "--total_context=4096", "--backend_type",
            "balance_serve", "--use_cuda_graph", "--cpu_infer", "8", "--log_level", "-1"]
    kept = drop_upstream_flags(argv, SERVER_FLAGS, SERVER_RENAMES)
    assert kept == ["--model_path", "/m", "--port", "10002", "--cache_lens=4096", "--cpu_infer", "8"]
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 6 and all(n.startswith("note: --") for n in notes)
    assert "--model_dir (an upstream KTransformers flag) is --model_path here" in notes[0]
    assert "--web" in notes[1] and "no effect" in notes[1]
    assert drop_upstream_flags(["--prompt", "hi"], CHAT_FLAGS) == ["--prompt", "hi"]


def test_console_script_with_flags_first_serves():
    out = subprocess.run([sys.executable, "-m", "ktransformers.cli", "--model_dir", "/m", "--web", "true", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "python -m ktransformers.server" in out.stdout
    assert "--model_dir (an upstream KTransformers flag) is --model_path here" in out.stderr
    usage = subprocess.run([sys.executable, "-m", "ktransformers.cli", "nonsense"], capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 2 and "usage: ktransformers {chat,serve}" in usage.stderr


@pytest.mark.parametrize("flags, value", [([], False), (["--force_think"], True), (["--force_think", "true"], True),
                                          (["--force_think", "False"], False), (["--force_think=1"], True)])
def test_force_think_takes_upstream_booleans(flags, value):
    from ktransformers.local_chat import parse_args
    assert parse_args(flags + ["--prompt", "hi"]).force_think is value


def test_upstream_import_path_of_the_loader():
    import ktransformers
    from ktransformers.optimize.optimize import optimize_and_load_gguf
    assert optimize_and_load_gguf is ktransformers.optimize_and_load_gguf


def test_model_path_as_a_repo_id_in_the_local_cache(tmp_path, monkeypatch):
    """A repo id resolves to its snapshot in the Hugging Face cache, without the network; one
    not there is a FileNotFoundError saying where it looked and what to do."""
    from huggingface_hub import constants

    from ktransformers.loader import resolve_model_path
    repo = tmp_path / "models--someorg--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("someorg/tiny-moe") == snapshot
    assert resolve_model_path(str(snapshot)) == snapshot  # a directory as it is
    assert resolve_model_path(None) is None
    with pytest.raises(FileNotFoundError, match=r"'someorg/absent' is neither a directory nor a model in the local "
                                                r"Hugging Face cache .*hf download someorg/absent"):
        resolve_model_path("someorg/absent")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"))


def test_a_rule_file_for_another_architecture_is_one_line(tmp_path):
    """A DeepSeek-V3 rule file given a Qwen3-MoE model: one line naming the file, the rule, the
    class and both architectures, from the loader's plan and from --dry-run alike."""
    import torch
    from tiny import tiny_model

    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.optimize.inject import plan
    from ktransformers.optimize.rules import RuleError, load_rules
    hf = tiny_model("qwen3_moe", layers=1)
    model = build_skeleton(hf.config, torch.float32)
    rules_file = RULES_DIR / "DeepSeek-V3-Chat-cpu.yaml"
    with pytest.raises(RuleError, match=r"DeepSeek-V3-Chat-cpu.yaml is for deepseek_v3 models \(rule \d+ matches class "
                                        r"DeepseekV3\w+\), not this qwen3_moe model"):
        plan(model, load_rules(rules_file), "cpu", f"rule file {rules_file}")
    assert plan(model, load_rules(RULES_DIR / "Qwen3Moe-cpu.yaml"), "cpu")  # its own file plans
    hf.config.save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "ktransformers.optimize", "--model_path", str(tmp_path),
                          "--optimize_config_path", str(rules_file), "--dry-run"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not this qwen3_moe model" in out.stderr


def test_a_slip_of_another_architecture_beside_the_models_own_rules_warns(tmp_path):
    """Upstream's DeepSeek-V2-Lite gpu-cpu file matches V3's MoEGate among V2 rules: those rules
    match nothing (a warning names them) and the rest places; its CPU linears' out_device puts
    their output where it says."""
    import torch
    from tiny import tiny_model

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import build_skeleton
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("deepseek_v2", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.BF16)
    rules = tmp_path / "slip.yaml"
    rules.write_text("""
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.gate$", class: ktransformers.models.modeling_deepseek_v3.MoEGate}
  replace: {class: ktransformers.operators.gate.KMoEGate}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: ktransformers.models.modeling_deepseek.DeepseekV2MoE}
  replace: {class: ktransformers.operators.experts.KDeepseekV2MoE}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace: {class: ktransformers.operators.experts.KTransformersExperts, kwargs: {generate_op: KExpertsCPU}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}
  replace: {class: ktransformers.operators.attention.KDeepseekV2Attention}
- match: {name: "^model\\\\.layers\\\\.(?!self_attn).*$", class: torch.nn.Linear}
  replace: {class: ktransformers.operators.linear.KTransformersLinear,
            kwargs: {generate_op: KLinearCPUInfer, prefill_op: KLinearTorch, out_device: cpu}}
""")
    model = build_skeleton(hf.config, torch.float32)
    with pytest.warns(UserWarning, match=r"rule\(s\) 0 match classes of other architectures \(DeepseekV3TopkRouter\)"):
        rows = {r.name: r.operator for r in optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)}
    assert rows["model.layers.1.mlp"] == "KDeepseekV2MoE" and rows["model.layers.1.mlp.gate"] == "default"
    assert model.model.layers[0].mlp.gate_proj.options.out_device == "cpu"
    ids = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(8))
    assert rel_err(logits(model, ids), logits(hf, ids)) < 3e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "glm4_moe"])
def test_a_skeleton_built_on_the_meta_device_loads(tmp_path, family):
    """Upstream's scripts build the model under `with torch.device("meta")`, buffers included:
    optimize_and_load_gguf computes the rotary tables again, and the logits are transformers'."""
    import torch
    from tiny import RULES, tiny_model
    from transformers import AutoModelForCausalLM

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model(family, layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.F32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    assert any(b.is_meta for b in model.buffers())
    optimize_and_load_gguf(model, RULES_DIR / RULES[family], tmp_path / "m.gguf", hf.config)
    ids = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    assert rel_err(logits(model, ids), logits(hf, ids)) < 1e-4


def test_a_rule_file_error_lists_every_wrong_rule(tmp_path):
    """Three wrong rules (an unknown operator, a bad kwarg, a bad regex) and one good one: the
    error names each wrong rule, with the valid operators for the unknown one."""
    from ktransformers.optimize.rules import RuleError, load_rules
    path = tmp_path / "bad.yaml"
    path.write_text('- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}\n'
                    '  replace: {class: KTransformersExpertsV9}\n'
                    '- match: {name: "^lm_head$"}\n'
                    '  replace: {class: default, kwargs: {generate_device: 7, prefill_device: 8}}\n'
                    '- match: {name: "(unclosed"}\n'
                    '  replace: {class: default}\n'
                    '- match: {name: "^model\\\\.norm$"}\n'
                    '  replace: {class: default}\n')
    with pytest.raises(RuleError) as e:
        load_rules(path)
    text = str(e.value)
    assert text.startswith(f"{path}: 3 rules are wrong:")
    assert "rule 0: replace.class: unknown operator 'KTransformersExpertsV9'; valid: default, " in text
    assert "rule 1: replace.kwargs.generate_device" in text and "rule 1: replace.kwargs.prefill_device" in text
    assert "rule 2: match.name: bad regular expression" in text and "rule 3" not in text


@pytest.mark.parametrize("spelling", ["ktransformers.operators.models.KDeepseekV2Model", "KQwen2MoeModel"])
def test_upstream_model_operator_keeps_the_model_and_sets_the_threshold(tmp_path, spelling):
    """`^model$` -> upstream's model-level operator loads: the model stays transformers' own, and
    per_layer_prefill_intput_threshold becomes every experts operator's prefill_gpu_threshold;
    a transfer_map must agree with where the layers' own rules put them."""
    import torch
    from tiny import RULES, tiny_model

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.operators.experts import KTransformersExperts
    from ktransformers.optimize.rules import RuleError
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.F32)
    shipped = (RULES_DIR / RULES["qwen3_moe"]).read_text()
    rules = tmp_path / "upstream.yaml"
    rules.write_text(f'- match:\n    name: "^model$"\n  replace:\n    class: "{spelling}"\n    kwargs:\n'
                     f'      per_layer_prefill_intput_threshold: 4096\n' + shipped)
    model = build_skeleton(hf.config, torch.float32)
    rows = optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)
    assert type(model.model).__name__ == "Qwen3MoeModel" and rows[0].name == "model"
    experts = [m for m in model.modules() if isinstance(m, KTransformersExperts)]
    assert experts and all(m.prefill_gpu_threshold == 4096 for m in experts)
    ids = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    assert rel_err(logits(model, ids), logits(hf, ids)) < 1e-4
    for where in ("cpu", "cuda:1"):  # a map that agrees with the layers' own rules, and one that does not
        rules.write_text(f'- match:\n    name: "^model$"\n  replace:\n    class: "{spelling}"\n    kwargs:\n'
                         f'      transfer_map: {{1: "{where}"}}\n' + shipped)
        model = build_skeleton(hf.config, torch.float32)
        if where == "cpu":
            optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)
            continue
        with pytest.raises(RuleError, match=r"rule 0: transfer_map puts layer 1 on cuda:1, but its rules put its "
                                            r"attention on cpu"):
            optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)


def test_upstream_v2_names_and_the_experts_backend(tmp_path):
    """Upstream's balance_serve names (KTransformersExpertsV2, VLinearMarlin, KDeepseekV3MoEV2,
    KMoEGateGreedy) are the operators and ops here; experts' `backend: AMXInt8` is int8_prefill,
    `llamafile` the GGML blocks, and AMXBF16 is refused naming the module and what to use."""
    import torch
    from tiny import RULES, tiny_model

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.operators.experts import KTransformersExperts
    from ktransformers.operators.registry import LINEAR_OPS, OPERATORS
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    assert OPERATORS.get("KTransformersExpertsV2") is OPERATORS.get("KTransformersExperts")
    assert OPERATORS.get("KDeepseekV3MoEV2") is OPERATORS.get("KDeepseekV3MoE")
    assert OPERATORS.get("KMoEGateGreedy") is OPERATORS.get("KMoEGate")
    assert LINEAR_OPS.get("VLinearMarlin") is LINEAR_OPS.get("KLinearMarlin")
    assert LINEAR_OPS.get("KLinearCPUInfer") is LINEAR_OPS.get("KLinearCPU")
    for alias, ours in (("KQwen3MoeSparseMoeBlockV2", "KQwen3MoeSparseMoeBlock"), ("KGlm4Experts", "KTransformersExperts"),
                        ("KMistralSparseMoEBlock", "KMixtralSparseMoeBlock"), ("KQwen3MoeRMSNorm", "RMSNorm"),
                        ("flashinfer_attn", "KDeepseekV2Attention"), ("RotaryEmbeddingV4", "KRotaryEmbedding")):
        assert OPERATORS.get(alias) is OPERATORS.get(ours), alias
    hf = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.Q8_0)
    shipped = (RULES_DIR / RULES["qwen3_moe"]).read_text()
    got = {}
    for backend in ("llamafile", "AMXInt8", "AMXBF16"):
        rules = tmp_path / f"{backend}.yaml"
        rules.write_text('- match:\n    name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"\n  replace:\n'
                         '    class: ktransformers.operators.experts.KTransformersExpertsV2\n'
                         f'    kwargs: {{generate_op: KExpertsCPU, prefill_op: KExpertsCPU, backend: {backend}}}\n' + shipped)
        model = build_skeleton(hf.config, torch.float32)
        if backend == "AMXBF16":
            with pytest.raises(ValueError, match=r"mlp\.experts'?: backend AMXBF16 .* use int8_prefill: true"):
                optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)
            continue
        optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)
        experts = [m for m in model.modules() if isinstance(m, KTransformersExperts)]
        assert experts and all(m.options.backend == backend for m in experts)
        assert all(m.ops["prefill"].spec.int8_prefill == (backend == "AMXInt8") for m in experts)
        ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
        got[backend] = logits(model, ids)
    for ours in got.values():
        assert rel_err(ours, logits(hf, ids)) < 5e-2


def test_transformers_4_module_names_of_upstream_rules(tmp_path):
    """Upstream's Mixtral rules name the MoE block `block_sparse_moe` and give each layer's
    `self_attn.rotary_emb` a rule (transformers 4's names): they place transformers 5's `mlp` and
    its one `model.rotary_emb`, and the model gives transformers' logits."""
    import torch
    from tiny import RULES, tiny_model

    from ktransformers import optimize_and_load_gguf
    from ktransformers.loader import RULES_DIR, build_skeleton
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model("mixtral", layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.F32)
    shipped = (RULES_DIR / RULES["mixtral"]).read_text()
    assert "\\\\.mlp" in shipped
    rules = tmp_path / "upstream-mixtral.yaml"
    rules.write_text('- match:\n    name: "^model\\\\.layers\\\\..*\\\\.self_attn\\\\.rotary_emb$"\n  replace:\n'
                     '    class: ktransformers.operators.RoPE.RotaryEmbedding\n'
                     '    kwargs: {generate_device: cpu, prefill_device: cpu}\n'
                     + shipped.replace("\\\\.mlp", "\\\\.block_sparse_moe"))
    model = build_skeleton(hf.config, torch.float32)
    rows = {r.name: r for r in optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)}
    assert rows["model.rotary_emb"].operator == "RotaryEmbedding"
    assert rows["model.layers.0.mlp.experts"].operator == "KTransformersExperts"
    ids = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    assert rel_err(logits(model, ids), logits(hf, ids)) < 1e-4


def test_linear_num_bits_is_honoured_or_refused():
    from ktransformers.operators.base import option_errors
    from ktransformers.operators.linear import LinearOptions
    assert option_errors(LinearOptions, {"num_bits": 4}) == []
    assert option_errors(LinearOptions, {"num_bits": 8}) == [("num_bits", "8 is not one of: 4")]


def test_another_familys_rotary_class_and_the_mlp_operators(tmp_path):
    """Upstream's Qwen3-MoE files match the rotary embedding by Qwen2-MoE's class, and place dense
    MLPs with `ktransformers.operators.mlp.*`: the first places the Qwen3 model's rotary_emb (it is
    no sign of another architecture), the second keeps the module as it is."""
    import torch
    from tiny import tiny_model

    from ktransformers.loader import build_skeleton
    from ktransformers.optimize.inject import plan
    from ktransformers.optimize.rules import parse_rules
    model = build_skeleton(tiny_model("qwen3_moe", layers=1).config, torch.float32)
    rules = parse_rules('- match: {class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeRotaryEmbedding}\n'
                        '  replace: {class: ktransformers.operators.RoPE.RotaryEmbedding}\n'
                        '- match: {name: "^model\\\\.layers\\\\.0\\\\.self_attn$"}\n'
                        '  replace: {class: ktransformers.operators.mlp.KQwen2MoeMLP}\n')
    rows = {r.name: r for r in plan(model, rules, "cpu")}
    assert rows["model.rotary_emb"].operator == "RotaryEmbedding" and rows["model.rotary_emb"].cls is not None
    assert rows["model.layers.0.self_attn"].operator == "KQwen2MoeMLP" and rows["model.layers.0.self_attn"].cls is None


# Rule files in the shape upstream's balance_serve and multi-GPU files take (written here, not
# copied): a model-level operator with its threshold and transfer_map, classes by upstream's
# module paths, V2 operator names, op names and kwargs of its own.
UPSTREAM_SHAPES = {
    "deepseek_v3": """
- match: {name: "^model$"}
  replace:
    class: "ktransformers.operators.models.KDeepseekV2Model"
    kwargs: {per_layer_prefill_intput_threshold: 0, transfer_map: {1: "cpu"}}
- match: {class: ktransformers.models.modeling_deepseek_v3.DeepseekV3YarnRotaryEmbedding}
  replace: {class: ktransformers.operators.RoPE.YarnRotaryEmbeddingV3, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}
  replace: {class: ktransformers.operators.balance_serve_attention.flashinfer_attn,
            kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE}
  replace: {class: ktransformers.operators.experts.KDeepseekV3MoEV2, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {class: ktransformers.models.modeling_deepseek_v3.MoEGate}
  replace: {class: ktransformers.operators.gate.KMoEGate, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace:
    class: ktransformers.operators.experts.KTransformersExpertsV2
    kwargs: {prefill_device: cpu, generate_device: cpu, generate_op: KExpertsCPU, prefill_op: KExpertsCPU,
             out_device: cpu, backend: llamafile}
  recursive: false
- match: {name: "^model\\\\.layers\\\\.0\\\\.mlp$"}
  replace: {class: ktransformers.operators.mlp.kDeepseekV3MLP, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*", class: torch.nn.Linear}
  replace: {class: ktransformers.operators.linear.KTransformersLinear,
            kwargs: {generate_device: cpu, prefill_device: cpu, generate_op: KLinearCPUInfer, prefill_op: KLinearTorch}}
""",
    "qwen3_moe": """
- match: {class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeRotaryEmbedding}
  replace: {class: ktransformers.operators.RoPE.RotaryEmbedding, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}
  replace: {class: ktransformers.operators.balance_serve_attention.KQwen3MoeAttention,
            kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: ktransformers.models.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock}
  replace: {class: ktransformers.operators.experts.KQwen3MoeSparseMoeBlockV2, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace:
    class: ktransformers.operators.experts.KTransformersExpertsV2
    kwargs: {prefill_device: cpu, generate_device: cpu, generate_op: KExpertsCPU, prefill_op: None, backend: AMXInt8}
  recursive: false
- match: {name: "^model\\\\.layers\\\\..*\\\\.(input_layernorm|post_attention_layernorm)$"}
  replace: {class: ktransformers.operators.layernorm.KQwen3MoeRMSNorm, kwargs: {generate_device: cpu, prefill_device: cpu}}
""",
    # transformers 4's module names (block_sparse_moe), upstream's Mistral spelling of the block
    "mixtral": """
- match: {class: ktransformers.models.modeling_mixtral.MixtralRotaryEmbedding}
  replace: {class: ktransformers.operators.RoPE.RotaryEmbedding, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*$", class: torch.nn.Linear}
  replace: {class: ktransformers.operators.linear.KTransformersLinear,
            kwargs: {generate_device: cpu, prefill_device: cpu, generate_op: KLinearCPU, prefill_op: KLinearTorch}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.block_sparse_moe$", class: ktransformers.models.modeling_mixtral.MixtralSparseMoeBlock}
  replace: {class: ktransformers.operators.experts.KMistralSparseMoEBlock}
- match: {name: "^model\\\\.layers\\\\..*\\\\.block_sparse_moe\\\\.experts$"}
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs: {prefill_device: cpu, prefill_op: KExpertsTorch, generate_device: cpu, generate_op: KExpertsCPU, out_device: cpu}
  recursive: False
- match: {name: "^model\\\\.layers\\\\..*\\\\."}
  replace: {class: "default", kwargs: {generate_device: cpu, prefill_device: cpu}}
""",
    # a model-level operator with its threshold, the block's own upstream name
    "qwen2_moe": """
- match: {class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeRotaryEmbedding}
  replace: {class: ktransformers.operators.RoPE.RotaryEmbedding, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock}
  replace: {class: ktransformers.operators.experts.KQwen2MoeSparseMoeBlock, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs: {prefill_device: cpu, prefill_op: KExpertsTorch, generate_device: cpu, generate_op: KExpertsCPU, out_device: cpu}
  recursive: False
- match: {name: "^model$"}
  replace: {class: "ktransformers.operators.models.KQwen2MoeModel", kwargs: {per_layer_prefill_intput_threshold: 0}}
- match: {name: "^model.embed_tokens"}
  replace: {class: "default", kwargs: {generate_device: cpu, prefill_device: cpu}}
""",
    # the serve file's names: GLM's own experts, attention, norm and rotary operators; prefill_op None
    "glm4_moe": """
- match: {class: ktransformers.models.modeling_glm4_moe.Glm4MoeRotaryEmbedding}
  replace: {class: ktransformers.operators.RoPE.KGlm4MoeRotaryEmbedding, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\.(?!.*mlp\\\\.shared_expert_gate).*$", class: torch.nn.Linear}
  replace: {class: ktransformers.operators.linear.KTransformersLinear,
            kwargs: {generate_device: cpu, prefill_device: cpu, generate_op: KLinearCPU, prefill_op: KLinearTorch}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp$", class: ktransformers.models.modeling_glm4_moe.Glm4MoeMoE}
  replace: {class: ktransformers.operators.experts.KGlm4MoeMoE, kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace:
    class: ktransformers.operators.experts.KGlm4Experts
    kwargs: {prefill_device: cpu, prefill_op: None, generate_device: cpu, generate_op: KExpertsCPU, out_device: cpu,
             n_deferred_experts: 1}
  recursive: False
- match: {name: "^model\\\\.layers\\\\..*\\\\.self_attn$"}
  replace: {class: ktransformers.operators.balance_serve_attention.KGlm4MoeAttention,
            kwargs: {generate_device: cpu, prefill_device: cpu}}
- match: {class: ktransformers.models.modeling_glm4_moe.Glm4MoeRMSNorm}
  replace: {class: ktransformers.operators.layernorm.KGlm4MoeRMSNorm, kwargs: {generate_device: cpu, prefill_device: cpu}}
""",
}
PLACED = {"deepseek_v3": {"model.rotary_emb": "YarnRotaryEmbeddingV3", "model.layers.1.self_attn": "flashinfer_attn",
                          "model.layers.1.mlp": "KDeepseekV3MoEV2", "model.layers.1.mlp.gate": "KMoEGate",
                          "model.layers.1.mlp.experts": "KTransformersExpertsV2", "model.layers.0.mlp": "kDeepseekV3MLP",
                          "model.layers.0.mlp.gate_proj": "KTransformersLinear"},
          "qwen3_moe": {"model.rotary_emb": "RotaryEmbedding", "model.layers.0.self_attn": "KQwen3MoeAttention",
                        "model.layers.1.mlp": "KQwen3MoeSparseMoeBlockV2", "model.layers.1.mlp.experts": "KTransformersExpertsV2",
                        "model.layers.0.input_layernorm": "KQwen3MoeRMSNorm"},
          "mixtral": {"model.rotary_emb": "RotaryEmbedding", "model.layers.0.mlp": "KMistralSparseMoEBlock",
                      "model.layers.1.mlp.experts": "KTransformersExperts",
                      "model.layers.0.self_attn.q_proj": "KTransformersLinear"},
          "qwen2_moe": {"model": "KQwen2MoeModel", "model.layers.1.mlp": "KQwen2MoeSparseMoeBlock",
                        "model.layers.1.mlp.experts": "KTransformersExperts"},
          "glm4_moe": {"model.rotary_emb": "KGlm4MoeRotaryEmbedding", "model.layers.1.mlp": "KGlm4MoeMoE",
                       "model.layers.1.mlp.experts": "KGlm4Experts", "model.layers.0.self_attn": "KGlm4MoeAttention",
                       "model.layers.0.input_layernorm": "KGlm4MoeRMSNorm",
                       "model.layers.0.self_attn.q_proj": "KTransformersLinear"}}


@pytest.mark.parametrize("family", list(UPSTREAM_SHAPES))
def test_upstream_shaped_rule_files_place_each_module(tmp_path, family):
    """Each module lands where the upstream-shaped file says, on a skeleton built on the meta device
    as upstream's scripts build it; the model loads and gives transformers' logits (the CPU
    kernels' bound)."""
    import torch
    from tiny import tiny_model
    from transformers import AutoModelForCausalLM

    from ktransformers import optimize_and_load_gguf
    from ktransformers.weights.ggml_quants import GGMLType
    from ktransformers.weights.gguf_write import write_gguf
    hf = tiny_model(family, layers=2)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=GGMLType.BF16)
    rules = tmp_path / "upstream.yaml"
    rules.write_text(UPSTREAM_SHAPES[family])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    rows = {r.name: r.operator for r in optimize_and_load_gguf(model, rules, tmp_path / "m.gguf", hf.config)}
    for name, operator in PLACED[family].items():
        assert rows[name] == operator, (name, rows[name])
    if family == "qwen3_moe":  # `prefill_op: None`: prefill runs on the generate op, on its device
        experts = model.model.layers[1].mlp.experts
        assert experts.ops["prefill"] is experts.ops["generate"] and type(experts.ops["generate"]).__name__ == "KExpertsCPU"
    ids = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(8))
    assert rel_err(logits(model, ids), logits(hf, ids)) < 3e-2
