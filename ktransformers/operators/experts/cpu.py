"""KExpertsCPU: the routed experts on the C++ CPU kernels, computing on the stored GGML blocks.
Fed from a GPU stream it runs in order with it (kernels/cuda_host.py), and may hand part of each
decode token's experts to the GPU over the bus (placement.py)."""
from __future__ import annotations

import warnings

import torch

from ..registry import EXPERT_OPS
from .adapters import KernelPairs
from .placement import PcieShare, auto_pcie_experts
from .reference import ExpertSpec, load_biases


class _CPUExpertsFunction(torch.autograd.Function):
    """y = experts(x, ids, weights) on the C++ kernels, with their backward (MoEKernel.backward):
    gradients for x and the routing weights, the experts frozen. x, ids, weights and y are CPU
    tensors (the caller moves them, so that autograd runs this backward on its CPU thread). Keeps
    x, ids and weights, and each pair's g and u from the forward (T * (H + 2K + 2 K I) * 4 bytes a
    layer), so that the backward reads only the three matrices its products need."""

    @staticmethod
    def forward(ctx, x, weights, ids, kernel):
        cpu_x = x.detach().to(torch.float32).contiguous()
        cpu_ids = ids.detach().to(torch.int64).contiguous()
        cpu_w = weights.detach().to(torch.float32).contiguous()
        y, gate_up = kernel.forward_keeping(cpu_x, cpu_ids, cpu_w)
        ctx.save_for_backward(cpu_x, cpu_ids, cpu_w, gate_up)
        ctx.kernel, ctx.dtypes = kernel, (x.dtype, weights.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        cpu_x, cpu_ids, cpu_w, gate_up = ctx.saved_tensors
        dx, dw = ctx.kernel.backward(cpu_x, cpu_ids, cpu_w, dy, gate_up)
        return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), None, None


@EXPERT_OPS.register("KExpertsCPU")
class KExpertsCPU:
    """The C++ CPU experts on the stored GGML blocks: views of the GGUF's stacked expert tensors
    (per-expert files are stacked once), repacked into 16-row tiles where the format has them and
    RAM holds them (context.cpu_tiles); types the kernels do not compute on, and FP8/other
    safetensors, are converted once to bf16."""

    checks_routing = True  # MoEKernel checks shapes and dtypes, the C++ side every expert id

    def __init__(self, spec: ExpertSpec, device: torch.device):
        if device.type != "cpu":
            raise ValueError(f"{spec.key}: KExpertsCPU runs on the CPU, not {device}")
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.kernel = None
        self.pcie: PcieShare | None = None  # pcie_experts' share, once loaded

    def _projection(self, weights, proj: str, shape: tuple[int, ...]):
        from ...kernels.cpu import ACTIVATION_BLOCK, ExpertWeights
        from ..linear import dense_weights
        name = f"{self.key}.{proj}_proj"
        stored = weights.raw_stacked(name)
        if stored is not None and int(stored[1].ggml_type) in ACTIVATION_BLOCK and stored[1].shape == shape:
            return ExpertWeights(stored[0], int(stored[1].ggml_type))
        return dense_weights(weights, name, shape, self.dtype)

    def load(self, weights, context) -> None:
        from ...kernels.cpu import MoEKernel
        self.context = context
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        gate, up = self._projection(weights, "gate", (E, I, H)), self._projection(weights, "up", (E, I, H))
        down = self._projection(weights, "down", (E, H, I))
        runtime = context.cpu_runtime()
        # training on AMX: the forward on int8 copies too (gate and up are the backward's own; down one
        # more), every expert of a step, and no tiles: AMX's GEMM beats the blocks' kernels at a
        # step's token counts (VNNI's and AVX2's do not)
        amx_training = self.spec.int8_backward and not self.spec.int4_group and runtime.ext.amx_available()
        int8, int4 = self._prefill_copies(runtime, (gate, up, down), amx_training)
        if self.spec.int4_decode and int4 is not None:
            gate = up = down = None  # (the int4 copies are the only weights; the stored bytes are let go)
        biases, self.bias = None, None  # (self.bias: gate_up [E, 2I], down [E, H] float32, or None)
        if self.spec.bias:
            self.bias = load_biases(weights, self.spec, "cpu", torch.float32)
            biases = (*self.bias[0].chunk(2, dim=1), self.bias[1])
        self.kernel = MoEKernel(runtime, experts=E, top_k=self.spec.top_k, hidden=H, intermediate=I, gate=gate, up=up,
                                down=down, name=self.key, int8=int8, int4=int4,
                                tiles=context.cpu_tiles and not amx_training, int8_min_tokens=1 if amx_training else 4,
                                biases=biases, swiglu_limit=self.spec.act.limit, swiglu_alpha=self.spec.act.alpha)
        self.kernel.int8_backward = self.spec.int8_backward
        self.pcie = self._pcie_share() if self.spec.pcie_experts else None

    def _prefill_copies(self, runtime, projections, amx_training: bool = False) -> tuple:
        """(int8, int4) re-quantized copies of (gate, up, down) for the prefill GEMM, as the spec
        asks (or amx_training: int8), from the bytes just mapped, one expert at a time; (None, None)
        without them."""
        spec = self.spec
        if not (spec.int8_prefill or spec.int4_group or amx_training):
            return None, None
        if not (runtime.ext.int4_gemm if spec.int4_group else runtime.ext.int8_gemm_vnni):  # (one warning for all layers)
            what = f"int4_prefill{'/int4_decode' if spec.int4_decode else ''}" if spec.int4_group else "int8_prefill"
            why = ("have no int4 GEMM (it needs AVX512-VNNI)" if spec.int4_group else
                   "run the int8 GEMM without VNNI, slower than on the stored blocks (it needs AVX512-VNNI or AVX-VNNI)")
            warnings.warn(f"{what} is off: the {runtime.isa} CPU kernels {why}; the experts stay as stored", stacklevel=3)
            return None, None
        from ...kernels.cpu import Int4Rows, Int8Rows
        E, H, I = spec.experts, spec.hidden, spec.intermediate
        shapes = ((E, I, H), (E, I, H), (E, H, I))
        if spec.int4_group:
            return None, tuple(Int4Rows.from_blocks(p, s, spec.int4_group) for p, s in zip(projections, shapes))
        return tuple(Int8Rows.from_blocks(p, s) for p, s in zip(projections, shapes)), None

    def _pcie_share(self) -> PcieShare | None:
        """The share pcie_experts asks for, or None (with a warning saying why) where it cannot run;
        "auto" is quietly 0 where the share cannot run or would not pay."""
        n, K = self.spec.pcie_experts, self.spec.top_k
        w = self.kernel._weights
        why = self._pcie_unsupported(w)
        auto = n == "auto"
        if auto:
            n = 0 if why else auto_pcie_experts(self.context, K, sum(p.data.numel() for p in w) // self.spec.experts)
            if n == 0:
                return None
        if not isinstance(n, int) or not 0 < n < K:
            raise ValueError(f"{self.key}: pcie_experts must lie in [0, {K - 1}] (top-k {K}), got {n}")
        if why is None:
            from ...kernels.triton.pcie_experts import HostRegistration
            tiles = tuple(p.data for p in w)
            try:
                return PcieShare(K - n, tuple(p.ggml_type for p in w), tiles, HostRegistration(tiles))
            except RuntimeError as e:  # e.g. the locked-memory limit (ulimit -l) of an unprivileged user
                why = str(e)
        if auto:  # (one warning for all layers: the same message)
            warnings.warn(f"pcie_experts auto is off: {why}; all experts stay on the CPU", stacklevel=2)
        else:
            warnings.warn(f"{self.key}: pcie_experts={n} is off: {why}; all experts stay on the CPU", stacklevel=2)
        return None

    def _pcie_unsupported(self, w) -> str | None:
        """Why the share cannot run on these (gate, up, down) weights here, or None."""
        if not torch.cuda.is_available():
            return "no CUDA device"
        if self.kernel.copies_only:
            return "the experts are int4 copies (int4_decode), which the GPU does not read"
        from ...kernels.triton.pcie_experts import supports
        why = supports(tuple(p.ggml_type for p in w), tuple(p.tiled for p in w), self.spec.hidden,
                       self.spec.intermediate)
        if why is None and not all(isinstance(p.data, torch.Tensor) for p in w):
            why = "the tiles are not torch tensors"
        return why

    def unload(self) -> None:
        if self.pcie is not None:
            self.pcie.registration.close()  # (before the tiles can be freed)
        self.pcie = None
        self.kernel = self.bias = None

    def pairs(self) -> KernelPairs:
        """The frozen per-pair products adapters on the experts build on (adapters.py)."""
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        return KernelPairs(self.kernel)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return self.kernel.forward(x, ids, weights).to(self.dtype)

    def trainable_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward, differentiable with respect to x and the routing weights (the experts stay
        frozen): CPU tensors in, float32 y [T, H] on the CPU out; what a training step calls."""
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if any(t.device.type != "cpu" for t in (x, ids, weights)):
            raise ValueError(f"{self.key}: trainable_forward takes CPU tensors")
        return _CPUExpertsFunction.apply(x, weights, ids, self.kernel)

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed=None, epilogue=None):
        """Queue the experts on the CPU threads and return at once; call the result to wait for y.
        From a GPU stream: `packed` and `epilogue` as kernels.cuda_host.submit_on_stream takes them."""
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if x.device.type == "cuda":  # in order with the GPU stream (and inside CUDA graphs)
            from ...kernels.cuda_host import submit_on_stream
            return submit_on_stream(self.kernel, self.context.host_staging(), x, ids, weights, self.dtype,
                                    share=self._share(x, ids, weights), packed=packed, epilogue=epilogue)
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = self.kernel.submit(x, ids, weights)
        runtime = self.kernel.runtime

        def wait() -> torch.Tensor:
            runtime.sync()
            return y.to(self.dtype)
        return wait

    def stage_inputs(self, x: torch.Tensor):
        """Where a launch before a call fed from x's GPU stream may store the call's inputs in
        passing (the router: HostStaging.pinned_inputs), or None where those launches do not fuse."""
        if self.kernel is None or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
            return None
        staging = self.context.host_staging()
        if not staging.fuses(x.device):
            return None
        col0 = self._share_col0(x)
        return staging.pinned_inputs(self.kernel, x, self.spec.top_k if col0 is None else col0)

    def _share_col0(self, x: torch.Tensor) -> int | None:
        """The first of the columns pcie_experts computes on the GPU for a step like x, or None."""
        from ...kernels.triton.pcie_experts import MAX_TOKENS
        if self.pcie is None or x.dim() != 2 or x.shape[0] > MAX_TOKENS:
            return None
        return self.pcie.col0

    def _share(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """submit_on_stream's `share` for a decode step with pcie_experts, else None."""
        from ...kernels.triton.pcie_experts import pcie_experts
        if self._share_col0(x) is None or any(t.stride(-1) != 1 for t in (x, ids, weights)):
            return None
        share, E, I = self.pcie, self.spec.experts, self.spec.intermediate
        return share.col0, lambda: pcie_experts(x, ids, weights, share.col0, *share.tiles, share.types, E, I)
