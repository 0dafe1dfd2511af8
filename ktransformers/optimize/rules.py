"""Parse and validate YAML rule files, and match rules against a model's modules.

A rule file is a list of rules:
    - match: {name: REGEX, class: DOTTED_CLASS}   # name = re.search on the dotted module name;
      replace: {class: OPERATOR, kwargs: {...}}   # class = isinstance; both must hold if both given
      recursive: true                             # false stops descent below a matched module
The first rule that matches a module wins. Everything is checked when the file loads: every
error names the file, the rule's index and the key, and lists the valid choices.
"""
from __future__ import annotations

import importlib
import re
import reprlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex
import yaml
from torch import nn

from ..operators.base import (UPSTREAM_MLP_OPERATORS, UPSTREAM_MODEL_OPERATORS, BaseInjectedModule, ModelPlacement,
                              Placement, option_errors)
from .. import operators  # noqa: F401  (importing the package registers every operator)
from ..operators.registry import OPERATORS

SAFE_PREFIXES = ("ktransformers.", "transformers.", "torch.")
# The modules a rule file may import from within those prefixes (before anything is imported): the
# operators, transformers' own model classes and torch.nn; not just any module under a prefix, whose
# import can have effects (torch.utils.cpp_extension, say, reached as a "class" path through it).
SAFE_MODULES = re.compile(r"^(ktransformers\.operators(\.\w+)?|transformers|transformers\.models\.\w+"
                          r"\.modeling_\w+|torch\.nn(\.modules)?(\.\w+)?)$")
MAX_RULE_BYTES = 1 << 20  # a rule file is a few KiB; more is no rule file
MAX_NODES = 100_000  # YAML nodes a rule file may stand for, aliases counted expanded
MATCH_TIMEOUT_S = 1.0  # one match.name regex against one module name
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 80, 80, 3, 6, 6
RULE_KEYS = {"match", "replace", "recursive"}
MATCH_KEYS = {"name", "class"}
REPLACE_KEYS = {"class", "kwargs"}
DEFAULT = "default"

# Upstream KTransformers shipped its own copies of the HF modeling files; their classes are
# transformers' classes now. Where the class name changed, say so here; the rest map by module.
_UPSTREAM_MODELS = {
    "modeling_deepseek_v3": "deepseek_v3",
    "modeling_deepseek": "deepseek_v2",
    "modeling_qwen3_moe": "qwen3_moe",
    "modeling_qwen2_moe": "qwen2_moe",
    "modeling_mixtral": "mixtral",
    "modeling_glm4_moe": "glm4_moe",
    "modeling_llama": "llama",
}
_UPSTREAM_RENAMES = {
    "ktransformers.models.modeling_deepseek_v3.MoEGate": "DeepseekV3TopkRouter",
    "ktransformers.models.modeling_deepseek.MoEGate": "DeepseekV2TopkRouter",
    "ktransformers.models.modeling_deepseek.DeepseekV2MoE": "DeepseekV2Moe",
    "ktransformers.models.modeling_deepseek.DeepseekV2YarnRotaryEmbedding": "DeepseekV2RotaryEmbedding",
    "ktransformers.models.modeling_deepseek_v3.DeepseekV3YarnRotaryEmbedding": "DeepseekV3RotaryEmbedding",
}


class RuleError(ValueError):
    """A rule file that cannot be used; the message says where and why."""


def _short(value: Any) -> str:
    """repr of a value from a rule file, bounded (a YAML alias tree can be vast if expanded)."""
    return _SHORT.repr(value)


class _BoundedLoader(yaml.SafeLoader):
    """safe_load's loader, bounded to MAX_NODES nodes with every alias counted as the subtree it
    stands for: a few lines of nested aliases (a "billion laughs") otherwise stand for a tree too
    big to walk or print."""

    def compose_node(self, parent, index):
        alias = self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        sizes = self.__dict__.setdefault("_sizes", {})
        self._expanded = getattr(self, "_expanded", 0) + (_node_size(node, sizes) if alias else 1)
        if self._expanded > MAX_NODES:
            raise yaml.YAMLError(f"the YAML stands for more than {MAX_NODES} nodes with its aliases (*name) expanded")
        return node


def _node_size(node, sizes: dict) -> int:
    """Nodes in the tree `node` stands for, aliases expanded (memoized by node: linear time)."""
    if id(node) not in sizes:
        if isinstance(node, yaml.SequenceNode):
            sizes[id(node)] = 1 + sum(_node_size(n, sizes) for n in node.value)
        elif isinstance(node, yaml.MappingNode):
            sizes[id(node)] = 1 + sum(_node_size(k, sizes) + _node_size(v, sizes) for k, v in node.value)
        else:
            sizes[id(node)] = 1
    return sizes[id(node)]


@dataclass(frozen=True)
class Rule:
    index: int
    name: regex.Pattern | None
    match_class: type | None
    operator: type | None  # None: keep the HF module ("default"), only place it
    kwargs: dict = field(default_factory=dict)
    recursive: bool = True
    operator_name: str = DEFAULT  # as the file spells it, without the module path

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.name is not None:
            try:
                found = self.name.search(name, timeout=MATCH_TIMEOUT_S)
            except TimeoutError:
                raise RuleError(f"rule {self.index}: match.name {_short(self.name.pattern)} took more than "
                                f"{MATCH_TIMEOUT_S:g} s on {name!r} (a regular expression that backtracks without bound)") from None
            if not found:
                return False
        if self.match_class is None or isinstance(module, self.match_class):
            return True
        # upstream's files name one family's rotary class for another's model (Qwen3-MoE's take
        # Qwen2-MoE's): a rotary class stands for the model's rotary embedding, whatever its family
        return _is_rotary(self.match_class) and _is_rotary(type(module))


def _is_rotary(cls: type) -> bool:
    return cls.__module__.startswith("transformers.models.") and cls.__name__.endswith("RotaryEmbedding")


def _upstream_model_path(path: str) -> str | None:
    parts = path.split(".")
    if len(parts) != 4 or parts[:2] != ["ktransformers", "models"] or parts[2] not in _UPSTREAM_MODELS:
        return None
    family = _UPSTREAM_MODELS[parts[2]]
    cls = _UPSTREAM_RENAMES.get(path, parts[3])
    return f"transformers.models.{family}.modeling_{family}.{cls}"


def _import_class(path: str, allow_prefixes: tuple[str, ...]) -> type:
    if not path.startswith(SAFE_PREFIXES + allow_prefixes):
        raise ValueError(
            f"{_short(path)} is outside {', '.join(SAFE_PREFIXES)}; a rule file may only import from those "
            "(pass allow_import_prefixes to opt in)")
    module_name, _, attr = path.rpartition(".")
    if not path.startswith(allow_prefixes) and not SAFE_MODULES.match(module_name):
        raise ValueError(f"{_short(path)}: a rule file imports classes from ktransformers.operators, transformers' "
                         "model modules and torch.nn only (pass allow_import_prefixes to opt in)")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from None
    if not isinstance(obj, type):
        raise ValueError(f"{path!r} is not a class")
    return obj


def resolve_match_class(path: str, allow_prefixes: tuple[str, ...] = ()) -> type:
    """A dotted class path (or an upstream KTransformers alias) to the class it names."""
    return _import_class(_upstream_model_path(path) or path, allow_prefixes)


def resolve_operator(name: str, allow_prefixes: tuple[str, ...] = ()) -> type | None:
    """A registered name, `ktransformers.operators.<module>.<Name>` (ours or upstream's), or a dotted path."""
    if name == DEFAULT:
        return None
    short = name.rpartition(".")[2]
    if short in UPSTREAM_MODEL_OPERATORS and (name == short or name == f"ktransformers.operators.models.{short}"):
        return ModelPlacement
    if short in UPSTREAM_MLP_OPERATORS and (name == short or name == f"ktransformers.operators.mlp.{short}"):
        return None  # the module stays as it is (placed like "default")
    if name in OPERATORS or (name.startswith("ktransformers.operators.") and short in OPERATORS):
        return OPERATORS.get(short)
    if "." not in name:
        raise ValueError(f"unknown operator {name!r}; valid: {DEFAULT}, {', '.join(OPERATORS.names())}")
    cls = _import_class(name, allow_prefixes)
    if not issubclass(cls, BaseInjectedModule):
        raise ValueError(f"{name!r} is not an operator (a BaseInjectedModule); valid: {', '.join(OPERATORS.names())}")
    return cls


class _RuleParser:
    def __init__(self, source: str, allow_prefixes: tuple[str, ...]):
        self.source = source
        self.allow = allow_prefixes

    def fail(self, index: int | None, key: str, message: str) -> RuleError:
        where = self.source if index is None else f"{self.source}: rule {index}"
        return RuleError(f"{where}: {key}: {message}")

    def check_keys(self, index: int, where: str, got: dict, valid: set[str]) -> None:
        unknown = sorted(set(got) - valid)
        if unknown:
            raise self.fail(index, f"{where}{str(unknown[0])[:80]}", f"unknown key; valid: {', '.join(sorted(valid))}")

    def parse(self, data: Any) -> list[Rule]:
        if data is None:
            return []
        if not isinstance(data, list):
            raise self.fail(None, "top level", f"expected a list of rules, got {type(data).__name__}")
        rules, problems = [], []
        for i, item in enumerate(data):  # every rule is checked: the error lists all that are wrong
            try:
                rules.append(self.parse_rule(i, item))
            except RuleError as e:
                problems.append(str(e))
        if len(problems) == 1:
            raise RuleError(problems[0])
        if problems:
            raise RuleError(f"{self.source}: {len(problems)} rules are wrong:\n  " + "\n  ".join(problems))
        return rules

    def parse_rule(self, i: int, item: Any) -> Rule:
        if not isinstance(item, dict):
            raise self.fail(i, "rule", f"expected a mapping with keys {sorted(RULE_KEYS)}, got {_short(item)}")
        self.check_keys(i, "", item, RULE_KEYS)
        for key in ("match", "replace"):
            if not isinstance(item.get(key), dict):
                raise self.fail(i, key, f"required, and must be a mapping (got {_short(item.get(key))})")
        self.check_keys(i, "match.", item["match"], MATCH_KEYS)
        self.check_keys(i, "replace.", item["replace"], REPLACE_KEYS)
        recursive = item.get("recursive", True)
        if not isinstance(recursive, bool):
            raise self.fail(i, "recursive", f"expected true or false, got {_short(recursive)}")
        name, match_class = self.parse_match(i, item["match"])
        operator, kwargs = self.parse_replace(i, item["replace"])
        return Rule(i, name, match_class, operator, kwargs, recursive, item["replace"]["class"].rpartition(".")[2])

    def parse_match(self, i: int, match: dict) -> tuple[re.Pattern | None, type | None]:
        if not match:
            raise self.fail(i, "match", "needs at least one of: name, class")
        name = match.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise self.fail(i, "match.name", f"expected a regular expression string, got {_short(name)}")
            try:  # (the regex package: its searches take a timeout, Rule.matches)
                name = regex.compile(name)
            except regex.error as e:
                raise self.fail(i, "match.name", f"bad regular expression {_short(match['name'])}: {e}") from None
        cls = match.get("class")
        if cls is not None:
            if not isinstance(cls, str):
                raise self.fail(i, "match.class", f"expected a dotted class path, got {_short(cls)}")
            try:
                cls = resolve_match_class(cls, self.allow)
            except ValueError as e:
                raise self.fail(i, "match.class", str(e)) from None
        return name, cls

    def parse_replace(self, i: int, replace: dict) -> tuple[type | None, dict]:
        if "class" not in replace or not isinstance(replace["class"], str):
            raise self.fail(i, "replace.class", f"required: an operator name or 'default' (got {_short(replace.get('class'))})")
        try:
            operator = resolve_operator(replace["class"], self.allow)
        except (ValueError, KeyError) as e:
            raise self.fail(i, "replace.class", str(e).strip('"')) from None
        kwargs = replace.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise self.fail(i, "replace.kwargs", f"expected a mapping, got {_short(kwargs)}")
        if operator is ModelPlacement:  # upstream's model-level operator: the module stays as it is
            operator, options = None, ModelPlacement
        else:
            options = Placement if operator is None else operator.Options
        errors = option_errors(options, kwargs)
        if errors:
            raise RuleError("; ".join(str(self.fail(i, f"replace.kwargs.{key}", message)) for key, message in errors))
        return operator, dict(kwargs)


def parse_rules(text: str, source: str = "<rules>", allow_import_prefixes: tuple[str, ...] = ()) -> list[Rule]:
    """Parse rule-file text (YAML: safe types, at most MAX_NODES nodes) into validated Rules."""
    if len(text) > MAX_RULE_BYTES:
        raise RuleError(f"{source}: {len(text)} characters; a rule file is at most {MAX_RULE_BYTES}")
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise RuleError(f"{source}: not valid YAML: {str(e)[:500]}") from None
    return _RuleParser(source, allow_import_prefixes).parse(data)


def load_rules(path: str | Path, allow_import_prefixes: tuple[str, ...] = ()) -> list[Rule]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rule file {str(path)!r} does not exist (or is not a regular file)")
    size = path.stat().st_size
    if size > MAX_RULE_BYTES:
        raise RuleError(f"{path}: {size} bytes; a rule file is at most {MAX_RULE_BYTES}")
    return parse_rules(path.read_text(), str(path), allow_import_prefixes)


def check_rules_fit(model: nn.Module, rules: list[Rule], source: str = "the rule file") -> None:
    """Rules whose match.class is a transformers model class of another architecture than the
    model's: where no rule names a class of the model's own, the file is one for that
    architecture, refused in one line before anything is placed (its operators would meet
    modules they were not written for); beside rules of the model's own classes they are a slip
    of the file's (upstream's DeepSeek-V2-Lite gpu-cpu file matches V3's MoEGate) and never
    match, as upstream's engine had it: one warning names them."""
    own = type(model).__module__
    foreign, native = [], False
    for rule in rules:
        cls = rule.match_class
        if cls is None or not cls.__module__.startswith("transformers.models.") or _is_rotary(cls):
            continue
        if cls.__module__ == own:
            native = True
        else:
            foreign.append(rule)
    if not foreign:
        return
    ours = own.split(".")[2] if own.startswith("transformers.models.") else own
    first = foreign[0]
    theirs = first.match_class.__module__.split(".")[2]
    if not native:
        raise RuleError(f"{source} is for {theirs} models (rule {first.index} matches class "
                        f"{first.match_class.__name__}), not this {ours} model: pass a rule file for {ours} (the "
                        f"shipped ones are in ktransformers/optimize_rules)")
    warnings.warn(f"{source}: rule(s) {', '.join(str(r.index) for r in foreign)} match classes of other architectures "
                  f"({', '.join(sorted({r.match_class.__name__ for r in foreign}))}), which this {ours} model has "
                  f"not: they match nothing", stacklevel=2)


# transformers 5 names some modules otherwise than transformers 4 did, which upstream's rule files
# were written against: a rule's match.name is tried on those spellings too
_V4_SPELLINGS = (
    (regex.compile(r"^model\.rotary_emb$"), "model.layers.0.self_attn.rotary_emb"),  # one table, once per layer then
    (regex.compile(r"^(model\.layers\.\d+)\.mlp(\.|$)"), r"\1.block_sparse_moe\2"),  # Mixtral's MoE block
)


def _spellings(name: str, module: nn.Module) -> list[str]:
    names = [name]
    for pattern, v4 in _V4_SPELLINGS:
        if pattern.search(name) and (".mlp" not in name or "Mixtral" in type(module).__name__):
            names.append(pattern.sub(v4, name))
    return names


def first_match(rules: list[Rule], name: str, module: nn.Module) -> Rule | None:
    names = _spellings(name, module)
    return next((r for r in rules if any(r.matches(n, module) for n in names)), None)
