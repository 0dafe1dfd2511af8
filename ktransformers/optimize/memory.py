"""Memory planning: before anything is loaded, the bytes each device will hold under a plan
(weights in the form their operators keep them, the KV cache, CUDA-graph buffers, pinned
staging), checked against what the devices have.

    mem = plan_memory(model, rows, weights, config, cache_lens=4096)   # model on the meta device
    print(mem.format()); check_budget(mem)                             # raises MemoryBudgetError

Figures are estimates from tensor sizes and stored types (what an operator keeps: GGML blocks
as stored for the CPU kernels, int4/int8 codes with per-32 scales for the Marlin/Q8 linears,
the model dtype for torch ops), not measurements.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..weights.ggml_quants import GGMLType, tensor_nbytes

GIB = 1 << 30


class MemoryBudgetError(ValueError):
    """The plan needs more memory on a device than it has (raised before loading)."""


@dataclass
class MemoryPlan:
    items: list[tuple[str, str, int]] = field(default_factory=list)  # (device, what, bytes)

    def add(self, device: str, what: str, nbytes: float) -> None:
        if nbytes > 0:
            self.items.append((_canonical(device), what, int(nbytes)))

    def per_device(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for device, _, n in self.items:
            out[device] += n
        return dict(out)

    def per_device_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for device, what, n in self.items:
            out[device][what] += n
        return {d: dict(w) for d, w in out.items()}

    def format(self) -> str:
        lines = [f"{'device':<8} {'total':>10}  of which"]
        for device, kinds in sorted(self.per_device_kind().items()):
            total = sum(kinds.values())
            parts = ", ".join(f"{what} {size(n)}" for what, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
            lines.append(f"{device:<8} {size(total):>10}  {parts}")
        return "\n".join(lines)


def size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _canonical(device: str) -> str:
    d = torch.device(device)
    return f"cuda:{d.index or 0}" if d.type == "cuda" else d.type


def _stored(weights, name: str) -> tuple[int | None, int]:
    """(ggml type, stored bytes) of one HF tensor, or (None, 0) when the source cannot say."""
    if weights is None:
        return None, 0
    try:
        info = weights.info(name)
    except Exception:  # composed tensors (stacked experts, split kv_b) have no single entry
        return None, 0
    numel = 1
    for s in info.shape:
        numel *= int(s)
    try:
        return int(info.ggml_type), tensor_nbytes(info.ggml_type, numel)
    except (ValueError, KeyError):
        return int(info.ggml_type), 0


def _group_bytes(ggml_type: int | None, numel: int, dtype_bytes: int, requantize: bool = False) -> float:
    """Bytes a Marlin/Q8 linear keeps: int4 (+8 B per 32) for Q4_0/Q4_K, int8 (+4 B per 32) for Q8_0."""
    if ggml_type in (GGMLType.Q4_0, GGMLType.Q4_K) or requantize:
        return numel * (0.5 + 8 / 32)
    if ggml_type == GGMLType.Q8_0:
        return numel * (1 + 4 / 32)
    return numel * dtype_bytes


def _linear_bytes(op: str, ggml_type, stored: int, numel: int, dtype_bytes: int, requantize: bool) -> float:
    if op == "KLinearCPU":
        return stored or numel * 2
    if op in ("KLinearMarlin",):
        return _group_bytes(ggml_type, numel, dtype_bytes, requantize)
    if op == "KLinearQ8":
        return numel * (1 + 4 / 32)
    if op == "KLinearFP8":
        return numel * (1 + 4 / (128 * 128))
    return numel * dtype_bytes


def _experts_bytes(op: str, stored: int, numel: int, dtype_bytes: int, types: list) -> float:
    if op == "KExpertsCPU":
        return stored or numel * 2
    if op in ("KExpertsGPU", "KExpertsMarlin"):
        return sum(_group_bytes(t, numel // 3, 2) for t in types) if types else numel * 2
    return numel * dtype_bytes


def _int4_bytes_per_weight(group) -> float:
    """Bytes a weight of int4 copies in groups of `group` columns: a nibble, and a float step a
    group. (A group the operator will refuse counts as the smallest valid one: the plan must not
    fail before the operator names what is wrong.)"""
    valid = isinstance(group, int) and not isinstance(group, bool) and group >= 64
    return 0.5 + 4 / (group if valid else 64)


def _phase_ops(kwargs: dict, default_op: str):
    """The distinct (op, device) pairs of an operator's prefill and generate phases."""
    seen = []
    for phase in ("prefill", "generate"):
        pair = (kwargs.get(f"{phase}_op", default_op), kwargs.get(f"{phase}_device", "cpu"))
        if pair not in seen:
            seen.append(pair)
    return seen


def plan_memory(model, rows, weights, config, dtype: torch.dtype | None = None, cache_lens: int | None = None,
                page_size: int = 256, max_batch: int = 8) -> MemoryPlan:
    """The bytes each device holds under `rows` (optimize.inject.plan of `model`, on meta)."""
    dtype = dtype or next(p.dtype for p in model.parameters())
    dbytes = torch.tensor([], dtype=dtype).element_size()
    mem = MemoryPlan()
    ops = {r.name: r for r in rows if r.cls is not None}
    placed = {r.name: r for r in rows}

    def owner(param: str):
        """The deepest operator row whose module holds `param`, else the row of its own module."""
        parts = param.split(".")
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in ops:
                return ops[prefix]
        module = ".".join(parts[:-1])
        while module and module not in placed:
            module = module.rpartition(".")[0]
        return placed.get(module)

    done_experts = set()
    layerwise: dict[str, float] = {}
    staging = 0.0
    attention = {r.name: r for r in rows if r.cls is not None and r.operator.endswith("Attention")}
    for name, p in model.named_parameters():
        row = owner(name)
        device = row.device if row is not None else "cpu"
        numel = p.numel()
        kw = row.kwargs if row is not None else {}
        op_name = row.operator.rsplit(".", 1)[-1] if row is not None else "default"
        if op_name == "KTransformersLinear":
            ggml_type, stored = _stored(weights, name)
            for op, dev in _phase_ops(kw, "KLinearTorch"):
                what = "weights (mapped file)" if op == "KLinearCPU" and stored else "weights"
                mem.add(dev, what, _linear_bytes(op, ggml_type, stored, numel, dbytes, bool(kw.get("requantize"))))
        elif op_name == "KTransformersExperts":
            if row.name in done_experts:
                continue
            done_experts.add(row.name)
            infos = [_stored(weights, f"{row.name}.{proj}_proj") for proj in ("gate", "up", "down")]
            stored = sum(n for _, n in infos)
            types = [t for t, _ in infos if t is not None]
            numel = sum(q.numel() for n, q in model.named_parameters() if n.startswith(row.name + "."))
            for op, dev in _phase_ops(kw, "KExpertsTorch"):
                int4_bytes = numel * _int4_bytes_per_weight(kw.get("int4_group", 128))
                if op == "KExpertsCPU" and kw.get("int4_decode"):  # the copies alone
                    mem.add(dev, "experts (int4)", int4_bytes)
                    continue
                what = "experts (mapped file)" if op == "KExpertsCPU" and stored else "experts"
                mem.add(dev, what, _experts_bytes(op, stored, numel, dbytes, types))
                if op == "KExpertsCPU" and kw.get("int4_prefill"):
                    mem.add(dev, "experts int4 copies", int4_bytes)
                elif op == "KExpertsCPU" and kw.get("int8_prefill"):
                    mem.add(dev, "experts int8 copies", numel * (1 + 8 / 256))
            experts = int(p.shape[0]) if p.dim() == 3 else 1
            hot = int(kw.get("num_gpu_experts") or 0)
            out_device = kw.get("out_device", "cpu")
            if hot:
                gpu = kw.get("gpu_experts_device") or (out_device if out_device.startswith("cuda") else "cuda")
                mem.add(gpu, "hot experts", _experts_bytes("KExpertsGPU", stored, numel, dbytes, types) * hot / experts)
            if kw.get("prefill_gpu_threshold") and out_device.startswith("cuda"):
                from ..operators.experts import LayerwisePrefill, PinnedSlots
                # transient, the largest layer's: a group of its experts in bf16 + two groups' stored bytes
                need = LayerwisePrefill.gpu_bytes(experts, numel * 2 // experts, int(stored or numel * 2),
                                                  int(kw.get("prefill_gpu_group_mb") or 0))
                layerwise[out_device] = max(layerwise.get(out_device, 0), need)
                staging = PinnedSlots.nbytes(LayerwisePrefill.CHUNK)  # the ring of page-locked chunks
        elif op_name in ("KMoEGate", "KMoEGateSoftmax") and device.startswith("cuda"):
            mem.add(device, "weights", numel * 4)  # routers on a GPU keep their weight in float32
        else:
            mem.add(device, "weights", numel * dbytes)
        mla = attention.get(name.rpartition(".kv_b_proj.")[0]) if ".kv_b_proj." in name else None
        if mla is not None and mla.operator.endswith(("DeepseekV2Attention", "DeepseekV3Attention")):
            mem.add(mla.device, "weights", numel * 4)  # W_uk / W_uv kept in float32 for absorption
    for device, need in layerwise.items():
        mem.add(device, "layer-wise prefill buffers", need)
    if staging:
        mem.add("cpu", "layer-wise prefill staging (pinned)", staging)
    if cache_lens:  # each layer's pages live on its attention's device
        capacity = -(-cache_lens // page_size) * page_size
        per_token = cache_values_per_token(config)
        layer_devices = [r.device for r in attention.values()] or ["cpu"] * config.num_hidden_layers
        for device in layer_devices:
            cache_dtype = 4 if torch.device(device).type == "cpu" and dtype == torch.float32 else dbytes
            mem.add(device, "KV cache", per_token * capacity * cache_dtype * config.num_hidden_layers
                    / len(layer_devices))
        for device in sorted(set(layer_devices)):
            if torch.device(device).type == "cuda":  # CUDA-graph static buffers: slot table + logits per batch size
                mem.add(device, "graph buffers", max_batch * (capacity * 4 + config.vocab_size * 4 * 2))
    return mem


def cache_values_per_token(config) -> int:
    """Values one layer's cache keeps per token: the MLA latent + rotated key, or GQA's K and V."""
    if getattr(config, "kv_lora_rank", None):
        return config.kv_lora_rank + config.qk_rope_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim


def parse_memory(text: str) -> dict[str, int]:
    """'0:20GiB,1:18GiB' (or 'cuda:0=20GB', 'cpu:100GiB') -> {'cuda:0': bytes, ...}."""
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    out = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(cuda:)?(\d+|cpu)\s*[:=]\s*([\d.]+)\s*([a-zA-Z]*)", part)
        if not m or m.group(4).lower() not in units:
            raise ValueError(f"cannot read memory budget {part!r}; expected e.g. '0:20GiB' or 'cpu:100GiB'")
        device = "cpu" if m.group(2) == "cpu" else f"cuda:{m.group(2)}"
        out[device] = int(float(m.group(3)) * units[m.group(4).lower()])
    return out


def available_memory() -> dict[str, int]:
    """What each device has now: free memory of every CUDA device; RAM: MemAvailable."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        out["cpu"] = info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        out["cpu"] = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = torch.cuda.mem_get_info(i)[0]
    return out


def tiles_fit(mem: MemoryPlan, budget: dict[str, int] | None = None) -> bool:
    """Whether the CPU kernels' mapped weights also fit in RAM as copies (the 16-row tiles they
    are repacked into), beside everything else planned for the CPU, with 1 GiB + 5% to spare."""
    ram = dict(budget or available_memory()).get("cpu")
    if ram is None:
        return True
    need = sum(mem.per_device_kind().get("cpu", {}).values())
    return need + (1 << 30) + ram // 20 <= ram


def check_budget(mem: MemoryPlan, budget: dict[str, int] | None = None) -> None:
    """Raise MemoryBudgetError naming each device whose planned bytes exceed its budget (default:
    available_memory()). The CPU kernels' weights are pages of the mapped GGUF: reclaimable page
    cache, not allocations, so they are listed but not counted against RAM (a file larger than
    RAM still runs, reading from disk). They are repacked into RAM copies (16-row tiles) only
    where tiles_fit says RAM holds them too."""
    budget = dict(budget or available_memory())
    problems = []
    for device, kinds in mem.per_device_kind().items():
        if device not in budget:
            continue
        need = sum(n for what, n in kinds.items() if "mapped file" not in what or device != "cpu")
        if need > budget[device]:
            parts = ", ".join(f"{what} {size(n)}" for what, n in kinds.items())
            hint = ("lower --cache_lens, keep fewer experts on the GPU (num_gpu_experts), or use a rule file that "
                    "places more on the CPU") if device.startswith("cuda") else \
                "use a smaller quantization, drop int8_prefill/int4_prefill copies, or lower --cache_lens"
            problems.append(f"{device} needs {size(need)} ({parts}) but has {size(budget[device])} free: {hint}")
    if problems:
        raise MemoryBudgetError("the model does not fit: " + "; ".join(problems))
