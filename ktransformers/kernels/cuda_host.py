"""CPU experts in order with a GPU stream: host functions, pinned staging buffers.

A MoE layer whose experts run on the CPU and whose activations live on a GPU is enqueued on the
current CUDA stream as

    copy x, ids, weights -> pinned buffers  |  host fn: submit the MoE job  |  (GPU work: shared
    experts, hot experts)  |  host fn: wait for the job  |  copy y -> GPU

so Python never blocks on the GPU, the GPU runs the shared experts while the CPU computes, and a
CUDA graph captured from the stream contains the whole step, CPU experts included. The host
functions are plain C functions of the extension (`moe_host_submit` / `moe_host_wait`, no
Python inside), enqueued with the driver's cuLaunchHostFunc through ctypes: the extension itself
needs no CUDA to build.

One staging area serves every layer of a model: the stream runs the layers one after another,
and each layer's job is waited for (on the stream) before the next layer's inputs are copied.
"""
from __future__ import annotations

import ctypes
import functools

import torch


@functools.lru_cache(maxsize=None)
def _driver_fn(name: str, argtypes: tuple | list):
    """A function of the CUDA driver library (libcuda.so.1) returning a CUresult."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"the CUDA driver library (libcuda.so.1) is not loadable: {e}") from None
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def _launch_host_func():
    return _driver_fn("cuLaunchHostFunc", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p))


def launch_host_func(fn: int, data: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue the C function `fn(data)` on a CUDA stream (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    rc = _launch_host_func()(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(data))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")


def call_host_func(fn: int, data: int) -> None:
    """Run the C function `fn(data)` now, on this thread (what the stream would run)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(ctypes.c_void_p(data))


class HostStaging:
    """Pinned buffers for one MoE call at a time (x, ids, weights, y) and the extension's
    MoEHostCall objects pointing at them, one per (kernel, token count, dtype)."""

    def __init__(self, runtime, pinned: bool = True):
        self.runtime = runtime
        self.pinned = pinned
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._calls: dict[tuple, object] = {}
        self._retired: list = []
        self.used: list = []  # the calls enqueued since the last check_errors()

    def _views(self, tokens: int, hidden: int, top_k: int, dtype: torch.dtype):
        item = torch.tensor([], dtype=dtype).element_size()
        sizes = [tokens * hidden * item, tokens * top_k * 8, tokens * top_k * 4, tokens * hidden * item]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + (n + 63) // 64 * 64)
        if offsets[-1] > self._buffer.numel():  # grow (outside graph capture: the engine warms up first)
            # the old buffer stays alive: CUDA graphs captured earlier copy into it, their host calls point at it
            self._retired.append((self._buffer, self._calls))
            self._buffer = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=self.pinned)
            self._calls = {}
        b = self._buffer
        x = b[offsets[0]:offsets[0] + sizes[0]].view(dtype).view(tokens, hidden)
        ids = b[offsets[1]:offsets[1] + sizes[1]].view(torch.int64).view(tokens, top_k)
        weights = b[offsets[2]:offsets[2] + sizes[2]].view(torch.float32).view(tokens, top_k)
        y = b[offsets[3]:offsets[3] + sizes[3]].view(dtype).view(tokens, hidden)
        return x, ids, weights, y

    def prepare(self, kernel, tokens: int, dtype: torch.dtype):
        """(x, ids, weights, y) pinned views and the MoEHostCall that reads/writes them."""
        from .cpu import _DTYPE_CODE
        x, ids, weights, y = self._views(tokens, kernel.hidden, kernel.top_k, dtype)
        key = (id(kernel), tokens, dtype, self._buffer.data_ptr())
        call = self._calls.get(key)
        if call is None:
            call = self.runtime.ext.MoEHostCall(kernel._moe, self.runtime._rt, tokens, ids.data_ptr(),
                                                weights.data_ptr(), x.data_ptr(), y.data_ptr(), _DTYPE_CODE[dtype])
            self._calls[key] = (call, kernel)  # (the kernel is kept alive with its call)
        else:
            call = call[0]
        return x, ids, weights, y, call

    def check_errors(self) -> None:
        """Raise the first error a host call recorded (after the stream ran them)."""
        used, self.used = self.used, []
        for call, name in used:
            error = call.take_error()
            if error:
                raise ValueError(f"{name}: {error}")


def submit_on_stream(kernel, staging: HostStaging, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     out_dtype: torch.dtype):
    """Enqueue the CPU MoE `kernel` on the current CUDA stream for GPU tensors x [T, H], ids/weights
    [T, K]; returns a function that enqueues the wait and the copy back, giving y [T, H] on x's device."""
    T = x.shape[0]
    if x.dim() != 2 or x.shape[1] != kernel.hidden or tuple(ids.shape) != (T, kernel.top_k) or \
            ids.shape != weights.shape or ids.dtype.is_floating_point:
        raise ValueError(f"{kernel.name}: expected x [T, {kernel.hidden}] and integer top_k_index / top_k_weights "
                         f"[T, {kernel.top_k}], got {tuple(x.shape)}, {tuple(ids.shape)} {ids.dtype}, "
                         f"{tuple(weights.shape)}")
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    xp, idp, wp, yp, call = staging.prepare(kernel, T, dtype)
    xp.copy_(x.to(dtype), non_blocking=True)
    idp.copy_(ids.to(torch.int64), non_blocking=True)
    wp.copy_(weights.to(torch.float32), non_blocking=True)
    ext = kernel.runtime.ext
    stream = torch.cuda.current_stream(x.device)  # the stream the copies above were ordered on
    launch_host_func(ext.moe_host_submit, call.address, stream)
    staging.used.append((call, kernel.name))

    def wait() -> torch.Tensor:
        launch_host_func(ext.moe_host_wait, call.address, stream)
        return yp.to(x.device, non_blocking=True).to(out_dtype)
    return wait
