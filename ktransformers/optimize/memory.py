"""Memory planning: before anything is loaded, the bytes each device will hold under a plan
(weights in the form their operators keep them, the KV cache, CUDA-graph buffers, pinned
staging), checked against what the devices have.

    mem = plan_memory(model, rows, weights, config, cache_lens=4096)   # model on the meta device
    print(mem.format()); check_budget(mem)                             # raises MemoryBudgetError

Figures are estimates from tensor sizes and stored types (what an operator keeps: GGML blocks
as stored for the CPU kernels, int4/int8 codes with group scales for the Marlin/Q8 linears,
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
    """Bytes a Marlin/Q8 linear or GPU expert keeps: int4 (+8 B per 32) for Q4_0/Q4_K, int8 (+4 B per
    32) for Q8_0."""
    if ggml_type in (GGMLType.Q4_0, GGMLType.Q4_K) or requantize:
        return numel * (0.5 + 8 / 32)
    if ggml_type == GGMLType.Q8_0:
        return numel * (1 + 4 / 32)
    return numel * dtype_bytes


def _linear_bytes(op: str, ggml_type, stored: int, numel: int, dtype_bytes: int, requantize: bool) -> float:
    if op == "KLinearCPU":
        return stored or numel * 2
    if op in ("KLinearMarlin", "KLinearQ8") and ggml_type == GGMLType.Q6_K:
        return numel * (1 + 4 / 16)  # int8 with Q6_K's per-16 scales
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
    if op in ("KExpertsGPU", "KExpertsMarlin"):  # (MXFP4 stays e2m1 codes, a float32 scale per 32)
        return sum(numel // 3 * (0.5 + 4 / 32) if t == GGMLType.MXFP4 else _group_bytes(t, numel // 3, 2)
                   for t in types) if types else numel * 2
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
    planner = _WeightsPlanner(model, rows, weights, torch.tensor([], dtype=dtype).element_size())
    for name, p in model.named_parameters():
        planner.add_parameter(name, p)
    mem = planner.finish()
    if cache_lens:
        layer_devices = [r.device for r in planner.attention.values()] or ["cpu"] * config.num_hidden_layers
        _add_kv_cache(mem, config, layer_devices, dtype=dtype, cache_lens=cache_lens, page_size=page_size,
                      max_batch=max_batch)
        for device in planner.linear_attention:
            mem.add(device, "recurrent states", recurrent_state_bytes(config, max_batch))
    return mem


@dataclass(frozen=True)
class _ExpertWeights:
    """One experts module's weights: stored bytes in the file, elements, stored types, experts."""

    stored: int
    numel: int
    types: list
    count: int


class _WeightsPlanner:
    """Walks the parameters once, adding each one's bytes where its operator keeps them."""

    def __init__(self, model, rows, weights, dbytes: int):
        self.model, self.weights, self.dbytes = model, weights, dbytes
        self.mem = MemoryPlan()
        self.ops = {r.name: r for r in rows if r.cls is not None}
        self.placed = {r.name: r for r in rows}
        self.attention = {r.name: r for r in rows if r.cls is not None and r.operator.endswith("Attention")}
        # a hybrid model's linear-attention layers: each one's device (its recurrent states live there)
        self.linear_attention = [r.device for r in rows if r.cls is not None and r.name.endswith(".linear_attn")]
        self.done_experts: set[str] = set()
        self.layerwise: dict[str, float] = {}  # device -> the largest layer's transient prefill buffers
        self.staging = 0.0  # pinned host chunks of layer-wise prefill

    def owner(self, param: str):
        """The deepest operator row whose module holds `param`, else the row of its own module."""
        parts = param.split(".")
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.ops:
                return self.ops[prefix]
        module = ".".join(parts[:-1])
        while module and module not in self.placed:
            module = module.rpartition(".")[0]
        return self.placed.get(module)

    def add_parameter(self, name: str, p) -> None:
        row = self.owner(name)
        device = row.device if row is not None else "cpu"
        op_name = row.operator.rsplit(".", 1)[-1] if row is not None else "default"
        if op_name == "KTransformersLinear":
            self._linear(row, name, p.numel())
        elif op_name == "KTransformersExperts":
            if row.name in self.done_experts:  # one entry for the whole module
                return
            self.done_experts.add(row.name)
            self._experts(row, p)
        elif op_name in ("KMoEGate", "KMoEGateSoftmax") and device.startswith("cuda"):
            self.mem.add(device, "weights", p.numel() * 4)  # routers on a GPU keep their weight in float32
        else:
            self.mem.add(device, "weights", p.numel() * self.dbytes)
        mla = self.attention.get(name.rpartition(".kv_b_proj.")[0]) if ".kv_b_proj." in name else None
        if mla is not None and mla.operator.endswith(("DeepseekV2Attention", "DeepseekV3Attention")):
            self.mem.add(mla.device, "weights", p.numel() * 4)  # W_uk / W_uv kept in float32 for absorption

    def _linear(self, row, name: str, numel: int) -> None:
        ggml_type, stored = _stored(self.weights, name)
        requantize = bool(row.kwargs.get("requantize"))
        for op, dev in _phase_ops(row.kwargs, "KLinearTorch"):
            what = "weights (mapped file)" if op == "KLinearCPU" and stored else "weights"
            self.mem.add(dev, what, _linear_bytes(op, ggml_type, stored, numel, self.dbytes, requantize))

    def _experts(self, row, p) -> None:
        infos = [_stored(self.weights, f"{row.name}.{proj}_proj") for proj in ("gate", "up", "down")]
        w = _ExpertWeights(stored=sum(n for _, n in infos), types=[t for t, _ in infos if t is not None],
                           numel=sum(q.numel() for n, q in self.model.named_parameters()
                                     if n.startswith(row.name + ".")),
                           count=int(p.shape[0]) if p.dim() == 3 else 1)
        for op, dev in _phase_ops(row.kwargs, "KExpertsTorch"):
            self._expert_phase(op, dev, row.kwargs, w)
        out_device = row.kwargs.get("out_device", "cpu")
        hot = int(row.kwargs.get("num_gpu_experts") or 0)
        if hot:
            gpu = row.kwargs.get("gpu_experts_device") or (out_device if out_device.startswith("cuda") else "cuda")
            full = _experts_bytes("KExpertsGPU", w.stored, w.numel, self.dbytes, w.types)
            self.mem.add(gpu, "hot experts", full * hot / w.count)
        if row.kwargs.get("prefill_gpu_threshold") and out_device.startswith("cuda"):
            self._layerwise_prefill(out_device, row.kwargs, w)

    def _expert_phase(self, op: str, dev: str, kw: dict, w: _ExpertWeights) -> None:
        """What one phase's experts operator keeps: the weights (mapped or converted) and copies."""
        int4_bytes = w.numel * _int4_bytes_per_weight(kw.get("int4_group", 128))
        if op == "KExpertsCPU" and kw.get("int4_decode"):  # the copies alone
            self.mem.add(dev, "experts (int4)", int4_bytes)
            return
        what = "experts (mapped file)" if op == "KExpertsCPU" and w.stored else "experts"
        self.mem.add(dev, what, _experts_bytes(op, w.stored, w.numel, self.dbytes, w.types))
        if op == "KExpertsCPU" and kw.get("int4_prefill"):
            self.mem.add(dev, "experts int4 copies", int4_bytes)
        elif op == "KExpertsCPU" and kw.get("int8_prefill"):
            self.mem.add(dev, "experts int8 copies", w.numel * (1 + 8 / 256))

    def _layerwise_prefill(self, device: str, kw: dict, w: _ExpertWeights) -> None:
        from ..operators.experts import LayerwisePrefill, PinnedSlots
        # transient, the largest layer's: a group of its experts in bf16 + two groups' stored bytes
        need = LayerwisePrefill.gpu_bytes(w.count, w.numel * 2 // w.count, int(w.stored or w.numel * 2),
                                          int(kw.get("prefill_gpu_group_mb") or 0))
        self.layerwise[device] = max(self.layerwise.get(device, 0), need)
        self.staging = PinnedSlots.nbytes(LayerwisePrefill.CHUNK)  # the ring of page-locked chunks

    def finish(self) -> MemoryPlan:
        for device, need in self.layerwise.items():
            self.mem.add(device, "layer-wise prefill buffers", need)
        if self.staging:
            self.mem.add("cpu", "layer-wise prefill staging (pinned)", self.staging)
        return self.mem


def _add_kv_cache(mem: MemoryPlan, config, layer_devices: list[str], *, dtype: torch.dtype, cache_lens: int,
                  page_size: int, max_batch: int) -> None:
    """Each layer's cache pages, on its attention's device, and the CUDA-graph static buffers."""
    dbytes = torch.tensor([], dtype=dtype).element_size()
    capacity = -(-cache_lens // page_size) * page_size
    per_token = cache_values_per_token(config)
    for device in layer_devices:  # (one per layer with attention: a hybrid model's linear layers keep no K/V)
        cache_dtype = 4 if torch.device(device).type == "cpu" and dtype == torch.float32 else dbytes
        mem.add(device, "KV cache", per_token * capacity * cache_dtype)
    for device in sorted(set(layer_devices)):
        if torch.device(device).type == "cuda":  # slot table + logits per batch size
            mem.add(device, "graph buffers", max_batch * (capacity * 4 + config.vocab_size * 4 * 2))


def recurrent_state_bytes(config, max_batch: int) -> int:
    """One linear-attention layer's recurrent states (cache.recurrent.HybridCache): conv and
    delta-rule states, float32, RING copies for each of `max_batch` sequences."""
    from ..cache.recurrent import RING
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (config.linear_conv_kernel_dim - 1)
    return 4 * RING * max_batch * (conv + hv * dk * dv)


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
