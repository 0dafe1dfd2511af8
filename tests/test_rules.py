"""Rule parsing, validation and matching semantics (DESIGN.md section 4)."""
import pytest
import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.operators.experts import KTransformersExperts
from ktransformers.operators.linear import KTransformersLinear
from ktransformers.operators.moe import KMoEBlock
from ktransformers.optimize.inject import format_plan, plan
from ktransformers.optimize.rules import RuleError, load_rules, parse_rules, resolve_match_class, resolve_operator
from tiny import tiny_config


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.b = nn.Linear(2, 2)
        self.ab = nn.Linear(2, 2)


def rows_of(text: str, model=None):
    return {r.name: r for r in plan(model or Toy(), parse_rules(text))}


LINEAR = "class: KTransformersLinear"


def test_name_is_re_search_and_first_match_wins():
    rows = rows_of(f"""
- match: {{name: "b$"}}
  replace: {{{LINEAR}, kwargs: {{generate_op: KLinearTorch}}}}
- match: {{name: "^b"}}
  replace: {{class: default, kwargs: {{generate_device: "cuda:1"}}}}
""")
    assert rows["b"].rule == 0 and rows["b"].operator == "KTransformersLinear"  # both match: first wins
    assert rows["ab"].rule == 0  # re.search, not fullmatch
    assert rows["a"].rule is None and rows["a.0"].rule is None


def test_class_is_isinstance_and_both_must_hold():
    rows = rows_of(f"""
- match: {{name: "^a", class: torch.nn.Linear}}
  replace: {{{LINEAR}}}
- match: {{class: torch.nn.Module}}
  replace: {{class: default, kwargs: {{generate_device: cpu}}}}
""")
    assert rows["a.0"].rule == 0
    assert rows["a"].rule == 1  # Sequential: name matches rule 0 but class does not
    assert rows["a.1"].rule == 1 and rows["b"].rule == 1


def test_recursive_false_stops_descent_and_default_places_subtree():
    rows = rows_of("""
- match: {name: "^a$"}
  replace: {class: default, kwargs: {generate_device: "cuda:0", prefill_device: "cuda:0"}}
  recursive: false
- match: {name: "^b$"}
  replace: {class: default, kwargs: {generate_device: "cuda:1", prefill_device: "cuda:1"}}
""")
    assert "a.0" not in rows and rows["a"].device == "cuda:0"
    assert rows["b"].device == "cuda:1" and rows["ab"].device == "cpu"
    rows = rows_of("""
- match: {name: "^a$"}
  replace: {class: default, kwargs: {generate_device: "cuda:0"}}
""")
    assert rows["a.0"].device == "cuda:0" and rows["a.0"].rule is None  # inherited from the placed parent


@pytest.mark.parametrize("text, key, expect", [
    ("- match: {name: '(' }\n  replace: {class: default}", "match.name", "bad regular expression"),
    ("- match: {name: a}\n  replace: {class: KNoSuchOp}", "replace.class", "KTransformersLinear"),
    ("- match: {name: a}\n  replace: {class: default}\n  recursiv: false", "recursiv", "valid: match, recursive, replace"),
    ("- match: {nme: a}\n  replace: {class: default}", "match.nme", "valid: class, name"),
    ("- match: {name: a}\n  replace: {class: default, kwrgs: {}}", "replace.kwrgs", "valid: class, kwargs"),
    (f"- match: {{name: a}}\n  replace: {{{LINEAR}, kwargs: {{generate_op: 3}}}}", "replace.kwargs.generate_op", "expected str"),
    (f"- match: {{name: a}}\n  replace: {{{LINEAR}, kwargs: {{generate_op: KLinearFoo}}}}", "replace.kwargs.generate_op", "KLinearTorch"),
    (f"- match: {{name: a}}\n  replace: {{{LINEAR}, kwargs: {{generate_device: gpu9}}}}", "replace.kwargs.generate_device", "not a device"),
    (f"- match: {{name: a}}\n  replace: {{{LINEAR}, kwargs: {{colour: red}}}}", "replace.kwargs.colour", "prefill_op"),
    ("- match: {name: a}\n  replace: {class: default}\n  recursive: maybe", "recursive", "true or false"),
    ("- match: {class: os.system}\n  replace: {class: default}", "match.class", "outside"),
    ("- match: {class: torch.nn.NoSuchThing}\n  replace: {class: default}", "match.class", "cannot import"),
    ("- match: {name: a}\n  replace: {class: torch.nn.Linear}", "replace.class", "not an operator"),
    ("- match: {}\n  replace: {class: default}", "match", "at least one"),
    ("- match: {name: a}", "replace", "required"),
])
def test_validation_names_file_rule_and_key(text, key, expect):
    with pytest.raises(RuleError) as err:
        parse_rules("- match: {name: ok}\n  replace: {class: default}\n" + text, "my_rules.yaml")
    message = str(err.value)
    assert message.startswith(f"my_rules.yaml: rule 1: {key}:"), message
    assert expect in message


def test_file_level_errors(tmp_path):
    with pytest.raises(RuleError, match="not valid YAML"):
        parse_rules("- match: [unclosed", "x.yaml")
    with pytest.raises(RuleError, match="expected a list of rules"):
        parse_rules("match: {name: a}", "x.yaml")
    with pytest.raises(RuleError, match="could not determine a constructor|not valid YAML"):
        parse_rules("- !!python/object/apply:os.system ['true']", "x.yaml")  # safe_load only
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_rules(tmp_path / "nope.yaml")
    assert parse_rules("", "empty.yaml") == []


def test_upstream_aliases_resolve():
    assert resolve_match_class("ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE") is DeepseekV3MoE
    assert resolve_match_class("ktransformers.models.modeling_deepseek_v3.MoEGate") is DeepseekV3TopkRouter
    assert resolve_operator("ktransformers.operators.experts.KTransformersExperts") is KTransformersExperts
    assert resolve_operator("ktransformers.operators.experts.KDeepseekV3MoE") is KMoEBlock
    assert resolve_operator("KQwen3MoeSparseMoeBlock") is KMoEBlock
    assert resolve_operator("ktransformers.operators.linear.KTransformersLinear") is KTransformersLinear
    assert resolve_operator("default") is None


def test_upstream_style_file_parses_and_plans():
    text = r"""
- match:
    class: ktransformers.models.modeling_deepseek_v3.DeepseekV3RotaryEmbedding
  replace:
    class: ktransformers.operators.RoPE.YarnRotaryEmbeddingV3
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^model\\.layers\\.(?!.*self_attn\\.kv_b_proj).*$"
    class: torch.nn.Linear
  replace:
    class: ktransformers.operators.linear.KTransformersLinear
    kwargs: {generate_device: "cpu", prefill_device: "cpu", generate_op: "KLinearTorch", prefill_op: "KLinearTorch"}
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs: {prefill_device: "cpu", prefill_op: "KExpertsTorch", generate_device: "cpu", generate_op: "KExpertsTorch", out_device: "cpu"}
  recursive: False
"""
    model = build_skeleton(tiny_config("deepseek_v3"), torch.float32)
    rows = {r.name: r for r in plan(model, parse_rules(text))}
    assert rows["model.layers.1.self_attn.kv_b_proj"].rule is None  # excluded by the negative lookahead
    assert rows["model.layers.1.self_attn.q_a_proj"].operator == "KTransformersLinear"
    assert rows["model.layers.2.mlp.experts"].operator == "KTransformersExperts"
    assert rows["model.rotary_emb"].operator == "YarnRotaryEmbeddingV3"
    table = format_plan(list(rows.values()))
    assert "model.layers.2.mlp.experts" in table and "KTransformersExperts" in table


@pytest.mark.parametrize("path", sorted(RULES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_rule_files_load(path):
    rules = load_rules(path)
    assert rules and all(r.index == i for i, r in enumerate(rules))


def test_dry_run_rows_for_shipped_file():
    model = build_skeleton(tiny_config("qwen3_moe"), torch.float32)
    rows = plan(model, load_rules(RULES_DIR / "Qwen3Moe-cpu.yaml"))
    by_op = {}
    for r in rows:
        by_op.setdefault(r.operator, []).append(r.name)
    assert by_op["KTransformersExperts"] == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert len(by_op["KMoEGateSoftmax"]) == 3 and "lm_head" in by_op["KTransformersLinear"]
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in sum(by_op.values(), []))  # recursive: false


def test_dry_run_cli(tmp_path):
    import subprocess
    import sys
    from ktransformers.weights.gguf_write import write_gguf
    from tiny import tiny_model
    model = tiny_model("mixtral", layers=1)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict())
    run = subprocess.run([sys.executable, "-m", "ktransformers.optimize", "--gguf_path", str(tmp_path / "m.gguf"),
                          "--dry-run"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "Mixtral-cpu.yaml" in run.stdout and "model.layers.0.mlp.experts" in run.stdout
    assert "KMixtralSparseMoeBlock" in run.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: x}\n  replace: {class: KNope}\n")
    run = subprocess.run([sys.executable, "-m", "ktransformers.optimize", "--gguf_path", str(tmp_path / "m.gguf"),
                          "--optimize_config_path", str(bad), "--dry-run"], capture_output=True, text=True)
    assert run.returncode == 2 and "bad.yaml: rule 0: replace.class: unknown operator 'KNope'" in run.stderr


def test_rule_files_are_bounded():
    """A rule file cannot hang or eat memory: YAML aliases are bounded (a 387-byte "billion laughs"
    once blew up inside an error message's repr), error messages are short, a regex that
    backtracks without bound fails its match with the rule named, the file's size is capped, and
    a class path is checked against the modules a rule may import before anything is imported."""
    import sys
    import time

    from ktransformers.optimize import rules as R
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    started = time.monotonic()
    with pytest.raises(R.RuleError, match="more than 100000 nodes"):
        R.parse_rules(laughs, "bomb.yaml")
    with pytest.raises(R.RuleError, match="more than 100000 nodes"):  # (inside a rule's kwargs too)
        R.parse_rules("- match: {name: a}\n  replace:\n    class: default\n    kwargs:\n      generate_device:\n"
                      + "".join("        " + line + "\n" for line in laughs.splitlines()), "kwargs.yaml")
    assert time.monotonic() - started < 10
    few = "- match: {name: a}\n  replace: &r {class: default}\n- match: {name: b}\n  replace: *r\n"
    assert len(R.parse_rules(few, "ok.yaml")) == 2  # (a few aliases are fine)
    started = time.monotonic()
    with pytest.raises(R.RuleError) as e:
        R.parse_rules("- match: {name: a}\n  replace: {class: default}\n  recursive: " + "[" * 20 + "1" + "]" * 20, "deep.yaml")
    assert len(str(e.value)) < 400 and time.monotonic() - started < 10
    with pytest.raises(R.RuleError, match="at most 1048576"):
        R.parse_rules("#" * (R.MAX_RULE_BYTES + 1), "big.yaml")
    (rule,) = R.parse_rules("- match: {name: '^(a|aa)+$'}\n  replace: {class: default}\n", "slow.yaml")
    with pytest.raises(R.RuleError, match=r"rule 0: match.name '\^\(a\|aa\)\+\$' took more than 1 s"):
        rule.matches("a" * 40 + "!", torch.nn.Linear(1, 1))
    sys.modules.pop("torch.utils.cpp_extension", None)
    with pytest.raises(R.RuleError, match="imports classes from ktransformers.operators"):
        R.parse_rules("- match: {class: torch.utils.cpp_extension.subprocess.Popen}\n  replace: {class: default}\n",
                      "import.yaml")
    assert "torch.utils.cpp_extension" not in sys.modules  # refused before the import


def test_expert_counts_file_must_be_a_small_regular_file(tmp_path):
    from ktransformers.operators.experts import hot_experts
    with pytest.raises(ValueError, match="must be a regular file"):
        hot_experts("model.layers.1.mlp.experts", 2, 4, "/dev/zero")
    bad = tmp_path / "counts.json"
    bad.write_text('{"model.layers.1.mlp.experts": "many"}')
    with pytest.raises(ValueError, match="has no list of counts"):
        hot_experts("model.layers.1.mlp.experts", 2, 4, str(bad))
