"""KTransformersExperts: replaces HF's fused experts module; dispatches by phase to an experts op
(EXPERT_OPS: reference, CPU, GPU), splits off hot experts, and runs long prefill chunks layer-wise
on the GPU."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...weights.lora import lora_scale
from ..base import BaseInjectedModule, Placement, choices, device_field
from ..registry import EXPERT_OPS, register_operator
from .adapters import ExpertAdapter, adapted_experts
from .gpu import KExpertsGPU
from .layerwise import LAYERWISE_GROUP_MB, LayerwisePrefill, PinnedSlots
from .placement import ExpertPlacement
from .reference import SWIGLU, Activation, ExpertSpec, check_routing


@dataclass(frozen=True)
class ExpertsOptions(Placement):
    # "None" (upstream's spelling): prefill runs on the generate op, where it lives
    prefill_op: str = field(default="KExpertsTorch", metadata=choices(lambda: EXPERT_OPS.names() + ["None"]))
    generate_op: str = field(default="KExpertsTorch", metadata=choices(EXPERT_OPS.names))
    out_device: str = device_field()
    int8_prefill: bool = False  # KExpertsCPU: int8 copies of the experts for a faster prefill GEMM
    # upstream's CPU backend: llamafile (the GGML blocks, as here by default) or AMXInt8 (= int8_prefill);
    # AMXBF16 (bf16 copies) is refused
    backend: str | None = field(default=None, metadata=choices(lambda: ["llamafile", "AMXInt8", "AMXBF16"]))
    # KExpertsCPU: int4 copies instead (groups of int4_group columns, a multiple of 64): 0.53 bytes a
    # weight at 128, against int8's 1 (2 with its AMX tiles)
    int4_prefill: bool = False
    int4_group: int = 128
    # KExpertsCPU: the int4 copies are the experts' only weights, for decode too (implies int4_prefill):
    # for BF16/FP8 checkpoints, whose experts would otherwise be kept in bf16 (0.53 bytes a weight, not 2)
    int4_decode: bool = False
    # hot experts: this many of the layer's experts also live on a GPU (KExpertsGPU) and the
    # router's choices are split between it and the CPU op (when the phase's op runs on the CPU)
    num_gpu_experts: int = 0
    gpu_experts_device: str | None = device_field(None)  # default: out_device when CUDA, else cuda
    expert_counts_file: str | None = None  # JSON of routing counts (bench/calibrate); without it: uniform
    # prefill chunks of at least this many tokens stream the layer's stored experts to the GPU and
    # compute there (LayerwisePrefill; 0: never); --prefill_gpu_threshold overrides it
    prefill_gpu_threshold: int = 0
    # layer-wise prefill dequantizes a layer's experts in groups of at most this many MiB of bf16
    # (the GPU holds about twice that for it; one expert at least)
    prefill_gpu_group_mb: int = field(default=LAYERWISE_GROUP_MB, metadata={"min": 1})
    # KExpertsCPU decoding from a GPU: of each token's top-k experts, the GPU computes this many
    # from the CPU's own tiles, read in place over PCIe while the CPU threads compute the rest
    # (kernels/triton/pcie_experts.py; 0: all on the CPU; "auto": the cost model's choice, placement.py)
    pcie_experts: int | str = 0
    # expert deferral (upstream's, as its rule files spell it): in decode, each token's this many
    # lowest-weight experts are computed after the layer's output is handed on, while the GPU runs
    # the next layer's attention, and their output joins the next MoE layer's (a KExpertsCPU
    # generate op; the model's last MoE layer defers none)
    n_deferred_experts: int = field(default=0, metadata={"min": 0})
    # KExpertsCPU in training: the backward's products on int8 copies (the transposed experts, made once:
    # 1 byte an expert weight more; the VNNI/AMX GEMMs, ~10x faster on the CPU) instead of decoding the
    # stored blocks in float32 (exact, no copies); with AMX the forward runs on int8 copies too (2 bytes
    # a weight), faster there than the tiles
    int8_backward: bool = False


def expert_shape(orig_module: nn.Module) -> tuple[int, int, int]:
    """(E, H, I) of transformers' fused experts, whose gate_up_proj is [E, 2I, H], or [E, H, 2I]
    where the class says its weights are transposed (gpt-oss)."""
    E, a, b = orig_module.gate_up_proj.shape
    return (E, a, b // 2) if getattr(orig_module, "is_transposed", False) else (E, b, a // 2)


def gate_up_interleaved(orig_module: nn.Module) -> bool:
    """Whether transformers' fused gate_up_proj alternates gate and up rows (gpt-oss) rather than
    holding them as halves: what an adapter's gate_up outputs follow."""
    return not getattr(orig_module, "is_concatenated", not getattr(orig_module, "is_transposed", False))


def expert_activation(orig_module: nn.Module) -> Activation:
    """The clamped SwiGLU where the experts carry its constants (gpt-oss's `limit` and `alpha`),
    else the plain one."""
    limit = getattr(orig_module, "limit", None)
    return SWIGLU if limit is None else Activation(float(limit), float(orig_module.alpha))


@register_operator("KTransformersExperts")
class KTransformersExperts(BaseInjectedModule):
    """HF experts' forward(hidden_states, top_k_index, top_k_weights) -> [T, H] on out_device."""

    Options = ExpertsOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        E, H, I = expert_shape(orig_module)
        self.n_experts = E
        top_k = getattr(config, "num_experts_per_tok", None) or E
        o = self.options
        if o.backend == "AMXBF16":
            raise ValueError(f"{key}: backend AMXBF16 (upstream's bf16 copies of the experts) is not here: use int8_prefill: "
                             f"true (int8 copies for prefill, AMX where the CPU has it) or the GGML blocks (backend: llamafile)")
        self.placement = ExpertPlacement(key, E, o.num_gpu_experts, o.expert_counts_file, o.pcie_experts)
        spec = ExpertSpec(key, E, H, I, top_k, orig_module.gate_up_proj.dtype, o.int8_prefill or o.backend == "AMXInt8",
                          self.placement.pcie, int4_group=self._int4_group(key, H, I),
                          int4_decode=o.int4_decode, act=expert_activation(orig_module),
                          bias=bool(getattr(orig_module, "has_bias", False)), int8_backward=o.int8_backward)
        self._check_gpu_options(spec)
        self.spec, self.top_k = spec, top_k
        self.interleaved = gate_up_interleaved(orig_module)
        # LoRA on the experts (add_adapters): {"gate_up_proj" / "down_proj": ExpertAdapter}; off while
        # adapters_enabled is False (DPO's reference)
        self.adapters: dict[str, ExpertAdapter] = {}
        self.adapters_enabled = True
        self._check_deferral(o.n_deferred_experts)
        self.n_deferred = o.n_deferred_experts  # link_expert_deferral hands them on
        prefill_op, prefill_device = ((o.generate_op, o.generate_device) if o.prefill_op == "None"
                                      else (o.prefill_op, o.prefill_device))
        self.ops = {"prefill": EXPERT_OPS.get(prefill_op)(spec, torch.device(prefill_device))}
        same = (prefill_op, prefill_device) == (o.generate_op, o.generate_device)
        self.ops["generate"] = self.ops["prefill"] if same else EXPERT_OPS.get(o.generate_op)(
            spec, torch.device(o.generate_device))
        self.hot = None  # KExpertsGPU over the hot experts, with their mask [E] on its device
        if self.placement.hot is not None:
            device = o.gpu_experts_device or (o.out_device if o.out_device.startswith("cuda") else "cuda")
            self.hot = KExpertsGPU(spec, torch.device(device), only=self.placement.hot)
            self.hot_mask = torch.zeros(E, dtype=torch.bool)
            self.hot_mask[self.placement.hot] = True
        self.layerwise = None  # LayerwisePrefill, when prefill chunks may run on the GPU
        self.prefill_gpu_threshold: int | None = None  # set_prefill_gpu_threshold's, over the option's
        if o.prefill_gpu_threshold and o.out_device.startswith("cuda"):
            self.layerwise = LayerwisePrefill(spec, torch.device(o.out_device), o.prefill_gpu_group_mb)

    def _check_gpu_options(self, spec: ExpertSpec) -> None:
        """The PCIe share's kernels compute the plain SwiGLU without biases: experts with biases or
        the clamped SwiGLU (gpt-oss) take hot experts and layer-wise prefill on the GPU, not it."""
        if (spec.bias or spec.act.limit is not None) and self.options.pcie_experts:
            raise ValueError(f"{self.key}: pcie_experts={self.options.pcie_experts}: the PCIe share's kernels do not "
                             "take experts with biases or the clamped SwiGLU (gpt-oss); use num_gpu_experts "
                             "(hot experts on the GPU) instead")

    def _int4_group(self, key: str, hidden: int, intermediate: int) -> int:
        """ExpertSpec.int4_group from the options (0 without int4_prefill or int4_decode), checked
        against the shapes."""
        o = self.options
        if not (o.int4_prefill or o.int4_decode):
            return 0
        if o.int8_prefill:
            raise ValueError(f"{key}: int8_prefill and int4_prefill/int4_decode are alternatives; set one")
        g = o.int4_group
        if g <= 0 or g % 64 or hidden % g or intermediate % g or intermediate % 16:
            raise ValueError(f"{key}: int4_group must be a multiple of 64 dividing hidden ({hidden}) and "
                             f"intermediate ({intermediate}), got {g}")
        return g

    def _check_deferral(self, n: int) -> None:
        o = self.options
        if n and (n < 0 or n >= self.top_k or o.generate_op != "KExpertsCPU"):
            raise ValueError(f"{self.key}: n_deferred_experts={n} needs generate_op KExpertsCPU (it is {o.generate_op}) "
                             f"and from 0 to top-k - 1 ({self.top_k - 1}) deferred experts")

    def set_phase(self, phase: str) -> None:
        super().set_phase(phase)
        kernel = getattr(self.ops["generate"], "kernel", None)
        if kernel is not None and kernel.deferral:
            kernel.set_deferring(phase == "generate")

    def _threshold(self) -> int:
        return self.options.prefill_gpu_threshold if self.prefill_gpu_threshold is None else self.prefill_gpu_threshold

    def load(self) -> None:
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(self.weights, self.run_context())
        if self.hot is not None:
            self.hot.load(self.weights, self.run_context())
            self.hot_mask = self.hot_mask.to(self.hot.device)
        if self.layerwise is not None:
            self.layerwise.load(self.weights, self.run_context(), self.ops["generate"])

    def unload(self) -> None:
        if self.layerwise is not None:  # (its registration of the CPU op's tiles first)
            self.layerwise.unload()
        for op in self.ops.values():
            op.unload()
        if self.hot is not None:
            self.hot.unload()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *, packed=None, epilogue=None) -> torch.Tensor:
        """y [T, H] on out_device, nothing to overlap: a CPU op runs on the calling thread with
        the pool (no hand-off to its task thread and back). `packed`, `epilogue`: see submit."""
        return self.submit(hidden_states, top_k_index, top_k_weights, overlap=False, packed=packed,
                           epilogue=epilogue)()

    def stage_inputs(self, hidden_states: torch.Tensor):
        """The pinned views (triton.handoff.PinnedInputs) a router launch may store this step's
        inputs in, where the op is the CPU experts fed from this GPU stream and nothing comes
        between the router and them (no hot-expert split, no layer-wise prefill); else None."""
        op = self.ops[self.phase]
        if self.hot is not None or not hasattr(op, "stage_inputs"):
            return None
        threshold = self._threshold() if self.layerwise is not None else 0
        if threshold and self.phase == "prefill" and hidden_states.shape[0] >= threshold:
            return None
        return op.stage_inputs(hidden_states)

    def submit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               overlap: bool = True, packed=None, epilogue=None):
        """Start the experts and return a function that waits for y [T, H] on out_device. A CPU op
        runs on its threads meanwhile (the caller computes shared experts, the hot experts run
        on the GPU); other ops finish before this returns. `overlap=False`: the caller has nothing
        to do meanwhile, so a CPU op fed from the CPU runs inline. For a CPU op fed from a GPU
        stream: `packed`, the pinned inputs (stage_inputs) a launch before stored already, and
        `epilogue`, what the caller does next with y (kernels.cuda_host.MoEEpilogue)."""
        op = self.ops[self.phase]
        adapted = bool(self.adapters) and self.adapters_enabled
        if adapted or torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
            return self._trainable(op, hidden_states, top_k_index, top_k_weights, adapted)
        threshold = self._threshold() if self.layerwise is not None else 0
        if threshold and self.phase == "prefill" and hidden_states.shape[0] >= threshold:
            y = self.layerwise.forward(hidden_states, top_k_index, top_k_weights)
            out_y = y.to(self.options.out_device, hidden_states.dtype)
            return lambda: out_y
        capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        if not getattr(op, "checks_routing", False) and not capturing:  # (C++ ops check ids; a graph may not sync)
            check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
        out, dtype = torch.device(self.options.out_device), hidden_states.dtype
        split = self.hot is not None and op.device.type == "cpu"
        ids = top_k_index
        if split:  # pairs of hot experts go to the GPU; the CPU op skips them (id -1)
            if hidden_states.device.type != "cuda":  # (on a GPU stream the C++ kernel checks the ids)
                check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
            on_gpu = self.hot_mask[top_k_index.to(self.hot.device)]
            ids = top_k_index.masked_fill(on_gpu.to(top_k_index.device), -1)
        # a CPU op fed from a GPU stream that stages its inputs itself (KExpertsCPU) takes the GPU
        # tensors; others (the torch reference on the CPU) take them moved to their device
        stages = hasattr(op, "stage_inputs") and op.device.type == "cpu" and hidden_states.device.type == "cuda"
        where = hidden_states.device if stages else op.device
        args = (hidden_states.to(where), ids.to(where), top_k_weights.to(where))
        if hasattr(op, "submit") and (overlap or split or where.type == "cuda"):
            handoff = {"packed": packed, "epilogue": None if split else epilogue} if where.type == "cuda" else {}
            pending = op.submit(*args, **handoff)
        else:
            y = op.forward(*args)
            pending = lambda: y  # noqa: E731
        gpu_y = None
        if split:
            dev = self.hot.device
            try:
                gpu_y = self.hot.forward(hidden_states.to(dev), top_k_index.to(dev), top_k_weights.to(dev))
            except BaseException:
                pending()  # the CPU call started above is waited for (see KMoEBlock.forward)
                raise

        def wait() -> torch.Tensor:
            y = pending().to(out, dtype)
            return y if gpu_y is None else y + gpu_y.to(out, dtype)
        return wait


    def add_adapters(self, rank: int, alpha: float, projections=("gate_up_proj", "down_proj"), use_rslora: bool = False,
                     init: bool = True, adapter_name: str = "default") -> None:
        """LoRA adapters (float32, trainable) on these experts' `projections`, on the adapters' device
        (adapter_device; adapters.py says how they compute). They are registered under the names
        peft gives its wrappers of transformers' experts parameters (gate_up's nested in down's,
        as base_layer), so that state dicts and saved adapters are the same as with transformers +
        peft (LoraConfig.target_parameters)."""
        if self.adapters:
            raise ValueError(f"{self.key}: the experts have adapters already")
        unknown = set(projections) - {"gate_up_proj", "down_proj"}
        if unknown or not projections:
            raise ValueError(f"{self.key}: expert adapters go on gate_up_proj and/or down_proj, got {list(projections)}")
        for name, op in {id(op): (n, op) for n, op in self.ops.items()}.values():
            if not hasattr(op, "pairs"):
                raise ValueError(f"{self.key}: LoRA on the experts needs KExpertsCPU or KExpertsTorch as the {name} op, "
                                 f"not {type(op).__name__}")
        E, H, I = self.n_experts, self.spec.hidden, self.spec.intermediate
        scaling = lora_scale(alpha, rank, use_rslora)
        shapes = {"gate_up_proj": (H, 2 * I), "down_proj": (I, H)}
        adapters = {p: ExpertAdapter(E, *shapes[p], rank, scaling, adapter_name, init).to(self.adapter_device())
                    for p in ("gate_up_proj", "down_proj") if p in projections}
        outer = adapters.get("down_proj") or adapters["gate_up_proj"]
        self.lora_A, self.lora_B = outer.lora_A, outer.lora_B
        if len(adapters) == 2:
            self.base_layer = adapters["gate_up_proj"]
        self.adapters = adapters
        for op in self.ops.values():
            kernel = getattr(op, "kernel", None)
            if kernel is not None:
                kernel.adapters = True

    def adapter_device(self) -> torch.device:
        """Where the experts' adapters live and their arithmetic runs: out_device where it is a GPU
        (the model trains there), else the experts op's device."""
        out = torch.device(self.options.out_device)
        return out if out.type == "cuda" else self.ops["prefill"].device

    def _trainable(self, op, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   adapted: bool):
        """A training step's experts (or any step's, with adapters): every expert on `op` (no
        hot-expert split, no layer-wise prefill: their GPU kernels have no backward),
        differentiable with respect to the hidden states, the routing weights and the adapters.
        Returns the wait, as submit does: the inputs' copies to the op's device are queued here,
        behind the router on the GPU stream, and the experts run when it is called, after the
        caller has queued its shared experts on the GPU. (The copies are torch's own, so autograd
        follows them; the CPU op's backward then runs on the autograd engine's CPU thread while
        the GPU's backward goes on.)"""
        if adapted and (self.hot is not None or self.layerwise is not None and self._threshold()):
            raise ValueError(f"{self.key}: LoRA on the experts runs every expert on the experts op: drop "
                             "num_gpu_experts and prefill_gpu_threshold from the rule file")
        check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
        need = "pairs" if adapted else "trainable_forward"
        if not hasattr(op, need):
            raise ValueError(f"{self.key}: {type(op).__name__} has no backward; training needs KExpertsCPU or "
                             "KExpertsTorch as the experts op")
        out, dtype = torch.device(self.options.out_device), hidden_states.dtype
        dev = self.adapter_device() if adapted else op.device
        # float32 for the CPU kernels and for the adapters (a bf16 model's hidden states too)
        f32 = torch.float32 if adapted or dev.type == "cpu" else None
        later = dev.type == "cpu"  # (copies to RAM are waited for below)
        inputs = (hidden_states.to(dev, f32 or hidden_states.dtype, non_blocking=later),
                  top_k_index.to(dev, non_blocking=later),
                  top_k_weights.to(dev, f32 or top_k_weights.dtype, non_blocking=later))
        copied = None
        if hidden_states.is_cuda and dev.type == "cpu":
            copied = torch.cuda.Event()
            copied.record()

        def wait() -> torch.Tensor:
            if copied is not None:
                copied.synchronize()
            if adapted:
                y = adapted_experts(*inputs, op.pairs(), self.adapters.get("gate_up_proj"),
                                    self.adapters.get("down_proj"), self.spec.act, op.bias, self.interleaved)
            else:
                y = op.trainable_forward(*inputs)
            return y.to(out, dtype)
        return wait


def set_prefill_gpu_threshold(model: nn.Module, tokens: int) -> None:
    """Prefill chunks of at least `tokens` tokens run the experts on the GPU (layer-wise prefill)
    in every layer that can, over the rule file's prefill_gpu_threshold (0: never); the CLI's
    --prefill_gpu_threshold."""
    if tokens < 0:
        raise ValueError(f"prefill_gpu_threshold must be at least 0, got {tokens}")
    for module in model.modules():
        if isinstance(module, KTransformersExperts):
            module.prefill_gpu_threshold = tokens


def link_expert_deferral(model: nn.Module) -> None:
    """Each MoE layer with deferred experts (n_deferred_experts, or set_expert_deferral's) hands
    them to the next MoE layer's CPU experts; the last one, with no layer after it, defers none."""
    chain = [m for m in model.modules() if isinstance(m, KTransformersExperts)]
    for a, b in zip(chain, chain[1:] + [None]):
        kernel = getattr(a.ops["generate"], "kernel", None)
        if kernel is None or not (a.n_deferred or kernel.deferral):
            continue
        nxt = getattr(b.ops["generate"], "kernel", None) if b is not None else None
        if a.n_deferred and b is not None and nxt is None:
            raise ValueError(f"{a.key}: n_deferred_experts={a.n_deferred} hands the deferred experts to the next MoE "
                             f"layer's CPU experts, but {b.key} computes its experts with {b.options.generate_op}")
        kernel.set_deferral(a.n_deferred if nxt is not None else 0, nxt)
        kernel.set_deferring(a.phase == "generate")


def set_expert_deferral(model: nn.Module, n: int) -> None:
    """Every MoE layer defers its tokens' `n` lowest-weight experts in decode (0: none), over the
    rule file's n_deferred_experts (bench.deferral compares settings on one loaded model)."""
    for module in model.modules():
        if isinstance(module, KTransformersExperts):
            module._check_deferral(n)
            module.n_deferred = n
    link_expert_deferral(model)


def cpu_expert_kernels(model: nn.Module) -> list:
    """The CPU experts' kernels (MoEKernel) of every MoE layer, prefill's and decode's once each."""
    kernels = {}
    for module in model.modules():
        if isinstance(module, KTransformersExperts):
            for op in module.ops.values():
                kernel = getattr(op, "kernel", None)
                if kernel is not None:
                    kernels[id(kernel)] = kernel
    return list(kernels.values())


def expert_bytes_read(kernels: list) -> int:
    """Bytes of expert weights `kernels` (cpu_expert_kernels') have streamed since they were
    made: each call reads each expert it routes to once, however many tokens share it."""
    return sum(k.experts_read * k.expert_bytes for k in kernels)


def link_layerwise_prefill(model: nn.Module) -> None:
    """Each MoE layer that may stream its experts to the GPU prefetches the next one's, and all of
    them stage through one ring of page-locked buffers."""
    chain = [m.layerwise for m in model.modules() if isinstance(m, KTransformersExperts) and m.layerwise is not None]
    slots = PinnedSlots()
    for a, b in zip(chain, chain[1:] + [None]):
        a.next, a.slots = b, slots
