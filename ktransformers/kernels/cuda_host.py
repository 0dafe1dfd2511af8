"""CPU experts in order with a GPU stream: pinned staging buffers, and a hand-off the stream
(and a CUDA graph captured from it) runs without Python.

A MoE layer whose experts run on the CPU and whose activations live on a GPU is enqueued on the
current CUDA stream as

    x, ids, weights -> pinned  |  start the CPU job  |  (GPU work: shared experts, hot
    experts)  |  wait for the job  |  copy y -> GPU

so Python never blocks on the GPU, the GPU runs the shared experts while the CPU computes, and a
CUDA graph of the step contains the CPU experts too. Two ways to start and wait:

- `doorbell` (default): the stream writes the call's number into the layer's `ring` word in
  pinned memory (cuStreamWriteValue32); the extension's Doorbell thread, polling the rings, runs
  the call inline on the pool and sets the layer's `done` word, which the stream waits for
  (cuStreamWaitValue32) and clears. No host-function node, no thread hand-off in between.
- `host`: host functions (cuLaunchHostFunc) of the extension, `moe_host_submit` queueing the job
  on the runtime's dispatcher and `moe_host_wait` waiting for it; the fallback where stream
  memory operations do not work (checked once per device, eagerly and inside a graph).

Both call plain C++ (no Python runs on the stream's behalf), through the driver's functions by
ctypes: the extension itself needs no CUDA to build.

The inputs reach the pinned buffer through one Triton kernel that stores them there, and y comes
back through one that reads it (pinned memory is addressable from the GPU), checked once per
device; else by a cast and three copies, and a copy back.

One staging area serves every layer of a model: the stream runs the layers one after another,
and each layer's job is waited for (on the stream) before the next layer's inputs are copied.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

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


def _driver_versioned(name: str, argtypes: tuple):
    """`name`_v2 (what CUDA 12's headers call) where the driver has it, else `name`."""
    try:
        return _driver_fn(name + "_v2", argtypes)
    except AttributeError:
        return _driver_fn(name, argtypes)


_MEMOP_ARGS = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


def stream_write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue: write the 32-bit `value` at `address` (pinned host memory) after the stream's earlier
    work, behind a system-wide fence (the v2 API's only mode: it refuses NO_MEMORY_BARRIER)."""
    rc = _driver_versioned("cuStreamWriteValue32", _MEMOP_ARGS)(
        ctypes.c_void_p(stream.cuda_stream), address, value, 0)
    if rc != 0:
        raise RuntimeError(f"cuStreamWriteValue32 failed (CUresult {rc})")


def stream_wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Enqueue: hold the stream until the 32-bit word at `address` equals `value`."""
    rc = _driver_versioned("cuStreamWaitValue32", _MEMOP_ARGS)(
        ctypes.c_void_p(stream.cuda_stream), address, value, WAIT_EQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")


def device_address(host: int) -> int:
    """The device's address of pinned host memory (under unified addressing, the same number)."""
    args = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint)
    fn = _driver_versioned("cuMemHostGetDevicePointer", args)
    out = ctypes.c_uint64(0)
    rc = fn(ctypes.byref(out), ctypes.c_void_p(host), 0)
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc}): is the memory pinned?")
    return out.value


@functools.lru_cache(maxsize=None)
def stream_memops_work(device_index: int) -> str | None:
    """None when cuStreamWriteValue32/cuStreamWaitValue32 on pinned memory work on this GPU, eagerly
    and replayed from a CUDA graph; else why not."""
    try:
        with torch.cuda.device(device_index):
            words = torch.zeros(16, dtype=torch.int32, pin_memory=True)
            base = device_address(words.data_ptr())
            stream = torch.cuda.Stream()
            stream_write_value(stream, base, 1)
            stream.synchronize()
            if words[0] != 1:  # (checked before any wait on it: a dropped write must not hang the probe)
                return f"a written word reads {int(words[0])}, expected 1"
            stream_wait_value(stream, base, 1)
            stream_write_value(stream, base + 4, 7)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                stream_write_value(stream, base + 8, 3)
                stream_wait_value(stream, base + 8, 3)
                stream_write_value(stream, base + 12, 5)
            graph.replay()
            torch.cuda.synchronize()
            if words[:4].tolist() != [1, 7, 3, 5]:
                return f"the words read {words[:4].tolist()}, expected [1, 7, 3, 5]"
    except Exception as e:  # noqa: BLE001 - any failure means: use host functions
        return str(e)
    return None


def launch_host_func(fn: int, data: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue the C function `fn(data)` on a CUDA stream (default: the current one)."""
    stream = stream or torch.cuda.current_stream()
    rc = _launch_host_func()(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(data))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")


def call_host_func(fn: int, data: int) -> None:
    """Run the C function `fn(data)` now, on this thread (what the stream would run)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(ctypes.c_void_p(data))


@dataclass
class _HostCall:
    """An MoEHostCall on the staging buffer, its kernel (kept alive with it), its doorbell number (0: none yet)."""
    call: object
    kernel: object
    number: int = 0


@dataclass
class MoEEpilogue:
    """What a decoder layer does next with the output y of a MoE call fed from its GPU stream:
    s = residual + y, then rms_norm(s) with (weight, eps), for the next layer. Passed to the call
    (submit_on_stream's `epilogue`); where the call reads y back by a kernel, that kernel does both
    (triton.handoff.copy_rows_add_norm) and leaves (y, s, norm) in `result`. The layer takes
    them only when the y it gets is that y (`done_for`); else it adds and normalizes itself."""
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    result: tuple | None = None

    def fits(self, y_shape: tuple, device: torch.device) -> bool:
        r = self.residual
        return (r.device == device and self.weight.device == device and r.numel() == y_shape[0] * y_shape[1]
                and r.shape[-1] == y_shape[1] and r.is_contiguous())

    def done_for(self, y: torch.Tensor) -> tuple | None:
        """(s, norm) shaped as y where `result` was made for this y, else None."""
        if self.result is None:
            return None
        y0, s, norm = self.result
        if y.data_ptr() != y0.data_ptr() or y.dtype != y0.dtype or y.numel() != y0.numel() or not y.is_contiguous():
            return None
        return s.view(y.shape), norm.view(y.shape)


HANDOFFS = ("doorbell", "host")  # how a GPU stream starts and waits for CPU experts (the module doc)


class HostStaging:
    """Pinned buffers for one MoE call at a time (x, ids, weights, y), the extension's MoEHostCall
    objects pointing at them, one per (kernel, token count, dtype), and in doorbell mode each
    kernel's ring/done words and the Doorbell thread that watches them.

    `handoff` ("doorbell" or "host"), `pack` and `fuse` choose the fallbacks the probes otherwise
    choose where the GPU needs them (host functions, copies instead of one packing kernel, the
    pack and read-back launches of their own): for tests of those paths."""

    WORD_STRIDE = 16  # int32 words between two flags: ring and done of a layer sit on cache lines of their own
    FLAG_CHUNK = 256  # layers' flag pairs per pinned chunk (chunks are never moved: graphs hold their addresses)

    def __init__(self, runtime, pinned: bool = True, handoff: str = "doorbell", pack: bool = True, fuse: bool = True):
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
        self.runtime = runtime
        self.pinned = pinned
        self.handoff_mode, self.pack, self.fuse = handoff, pack, fuse
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._calls: dict[tuple, _HostCall] = {}  # (id(kernel), tokens, dtype, buffer address) -> call
        self._retired: list = []
        self.used: list = []  # the calls enqueued since the last check_errors()
        self.doorbell = None  # the extension's Doorbell, once a kernel is fed in doorbell mode
        self._flags: dict[int, tuple[int, int, object]] = {}  # id(kernel) -> (ring, done) host addresses, kernel
        self._device_flags: dict[int, tuple[int, int]] = {}  # id(kernel) -> the same as device addresses
        self._flag_chunks: list[torch.Tensor] = []
        self._free_flags = 0
        self.mode: dict[int, str] = {}  # CUDA device index -> "doorbell" or "host"
        self._packs: dict[int, bool] = {}  # CUDA device index -> inputs written by one kernel (packs())
        self._bad_rings = 0  # the doorbell's count of rings naming no call, as last checked

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
        x, ids, weights, y = self._views(tokens, kernel.hidden, kernel.top_k, dtype)
        return (x, ids, weights, y, self._entry(kernel, tokens, dtype, (x, ids, weights, y)).call)

    def _entry(self, kernel, tokens: int, dtype: torch.dtype, views: tuple | None = None) -> _HostCall:
        """The call of (kernel, tokens, dtype) on the current buffer, made from its views on first use."""
        from .cpu import _DTYPE_CODE
        key = (id(kernel), tokens, dtype, self._buffer.data_ptr())
        entry = self._calls.get(key)
        if entry is None:
            x, ids, weights, y = views
            call = self.runtime.ext.MoEHostCall(kernel._moe, self.runtime._rt, tokens, ids.data_ptr(),
                                                weights.data_ptr(), x.data_ptr(), y.data_ptr(), _DTYPE_CODE[dtype])
            entry = self._calls[key] = _HostCall(call, kernel)
        return entry

    def handoff(self, device: torch.device) -> str:
        """How calls fed from this GPU start and finish: 'doorbell' or 'host' (see the module doc)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.mode and torch.cuda.is_current_stream_capturing():
            return "host"  # (no probe inside a capture; engines warm up eagerly first, so this is rare)
        if index not in self.mode:
            mode = self.handoff_mode if self.pinned else "host"
            why = stream_memops_work(index) if mode == "doorbell" else None
            if why is not None:
                import warnings
                warnings.warn(f"CPU experts on cuda:{index}: stream memory operations do not work ({why}); "
                              "using host functions", stacklevel=3)
                mode = "host"
            self.mode[index] = mode
        return self.mode[index]

    def packs(self, device: torch.device) -> bool:
        """Whether x, ids and weights reach the pinned buffer by one kernel's stores and y comes
        back by one kernel's loads (triton.handoff) rather than copies."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._packs:
            if torch.cuda.is_current_stream_capturing():
                return False  # (no probe inside a capture; engines warm up eagerly first)
            why = None
            if self.pinned and self.pack:  # probe it, say when it fails
                from .triton.common import runs_on
                from .triton.handoff import packs_into_pinned
                why = packs_into_pinned(index) if runs_on(device) else "no Triton"
                if why is not None:
                    import warnings
                    warnings.warn(f"CPU experts on cuda:{index}: inputs copied, not packed ({why})", stacklevel=3)
            self._packs[index] = self.pinned and self.pack and why is None
        return self._packs[index]

    def fuses(self, device: torch.device) -> bool:
        """Whether launches around a call fed from this GPU may do its pack and read-back in
        passing (packs())."""
        return self.fuse and self.packs(device)

    def pinned_inputs(self, kernel, x: torch.Tensor, cpu_k: int):
        """The pinned views a call of `kernel` on x [T, H] reads its inputs from, for a launch
        before it to store them (triton.handoff.PinnedInputs), to give to submit_on_stream."""
        from .triton.handoff import PinnedInputs
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        xp, idp, wp, _, _ = self.prepare(kernel, x.shape[0], dtype)
        return PinnedInputs(xp, idp, wp, cpu_k)

    def number(self, kernel, tokens: int, dtype: torch.dtype) -> int:
        """The doorbell number of the call prepare() made for these (registered on first use)."""
        entry = self._entry(kernel, tokens, dtype)
        if not entry.number:
            entry.number = self._bell().add(entry.call)
        return entry.number

    def flags(self, kernel) -> tuple[int, int]:
        """(ring, done) host addresses of the kernel's words, watched by the doorbell."""
        entry = self._flags.get(id(kernel))
        if entry is None:
            if self._free_flags == 0:
                self._flag_chunks.append(torch.zeros(2 * self.FLAG_CHUNK * self.WORD_STRIDE, dtype=torch.int32,
                                                     pin_memory=self.pinned))
                self._free_flags = self.FLAG_CHUNK
            chunk, k = self._flag_chunks[-1], self.FLAG_CHUNK - self._free_flags
            self._free_flags -= 1
            ring = chunk.data_ptr() + 2 * k * self.WORD_STRIDE * 4
            done = ring + self.WORD_STRIDE * 4
            self._bell().watch(ring, done)
            entry = self._flags[id(kernel)] = (ring, done, kernel)
        return entry[0], entry[1]

    def device_flags(self, kernel) -> tuple[int, int]:
        """(ring, done) as the GPU addresses them (looked up once a kernel)."""
        entry = self._device_flags.get(id(kernel))
        if entry is None:
            entry = self._device_flags[id(kernel)] = tuple(device_address(a) for a in self.flags(kernel))
        return entry

    # The doorbell thread spins this long after its last call: longer than the gap between two
    # decode steps (sampling, detokenizing), so a generation's steps find it awake.
    DOORBELL_SPIN_US = 20_000

    def _bell(self):
        if self.doorbell is None:
            self.doorbell = self.runtime.ext.Doorbell(self.runtime._rt, self.DOORBELL_SPIN_US)
        return self.doorbell

    def wake(self) -> None:
        """A step is about to run: let the doorbell and the pool's workers spin (no-op in host mode)."""
        if self.doorbell is not None:
            self.doorbell.wake()

    def rest(self) -> None:
        """The step's calls are all done (its streams synchronized): the doorbell thread and the
        pool's workers stop spinning until the next wake(), leaving the cores to Python between
        steps: otherwise every core has a spinning thread pinned to it then, and the host's part
        of a step (sampling, the next step's inputs, the graph's launch) is starved of cores."""
        if self.doorbell is not None:
            self.doorbell.rest()

    def check_errors(self) -> None:
        """Raise the first error a host call recorded (after the stream ran them)."""
        used, self.used = self.used, []
        self.check_calls(used)

    def check_calls(self, calls) -> None:
        """Raise the first error these (call, name) pairs recorded, once the stream ran them (each
        taken: said once), or a ring that named no call."""
        for call, name in calls:
            error = call.take_error()
            if error:
                raise ValueError(f"{name}: {error}")
        bad = self.doorbell.bad_rings if self.doorbell is not None else 0
        if bad != self._bad_rings:
            self._bad_rings = bad
            raise RuntimeError("a GPU stream rang the CPU experts' doorbell with a number that names no call "
                               "(their outputs of that step are stale)")


def submit_on_stream(kernel, staging: HostStaging, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     out_dtype: torch.dtype, share=None, packed=None, epilogue: MoEEpilogue | None = None):
    """Enqueue the CPU MoE `kernel` on the current CUDA stream for GPU tensors x [T, H], ids/weights
    [T, K]; returns a function that enqueues the wait and the copy back, giving y [T, H] on x's device.

    `share`: (col0, launch) where the GPU computes the pairs of columns col0.. itself: the CPU
    kernel gets them as -1 (skipped), `launch()` is enqueued right after the CPU is rung (it
    runs while the CPU threads compute) and returns float32 [T, H], added to the CPU's y in the
    copy back. Only where the inputs are packed by the kernel (else ignored: all on the CPU).
    `packed`: the pinned inputs (HostStaging.pinned_inputs) a launch before this one stored
    already; `epilogue`: what the caller does next with y, done in the read-back launch where
    it fuses (its `result` then holds y, the sum and its norm)."""
    _check_inputs(kernel, x, ids, weights)
    T = x.shape[0]
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    xp, idp, wp, yp, call = staging.prepare(kernel, T, dtype)
    packs = staging.packs(x.device)
    if packs and x.stride(-1) == 1 and ids.stride(-1) == 1 and weights.stride(-1) == 1:
        cpu_k = kernel.top_k if share is None else share[0]
        if packed is None or not packed.holds(x, ids, weights, (xp, idp, wp), cpu_k):
            from .triton.handoff import pack_moe_inputs
            pack_moe_inputs(x, ids, weights, xp, idp, wp, cpu_k=cpu_k)  # one launch, stores straight into pinned memory
    else:
        share = None
        xp.copy_(x.to(dtype), non_blocking=True)
        idp.copy_(ids.to(torch.int64), non_blocking=True)
        wp.copy_(weights.to(torch.float32), non_blocking=True)
    stream = torch.cuda.current_stream(x.device)  # the stream the copies above were ordered on
    staging.used.append((call, kernel.name))
    wait_cpu = _ring(kernel, staging, call, stream, x.device, T, dtype)
    read_back = packs and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
    if epilogue is not None and not (read_back and staging.fuses(x.device) and epilogue.fits(yp.shape, x.device)):
        epilogue = None
    extra = None

    def wait() -> torch.Tensor:
        wait_cpu()
        with torch.cuda.stream(stream):  # after the wait above, whichever stream the caller is on now
            return _copy_back(yp, x.device, out_dtype, read_back, extra, epilogue)
    if share is not None:
        try:
            extra = share[1]()  # the GPU's share, while the CPU threads compute theirs
        except BaseException:
            wait()  # the rung call is waited for (its done word consumed), then the error raised
            raise
    return wait


def _check_inputs(kernel, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    T = x.shape[0]
    if x.dim() != 2 or x.shape[1] != kernel.hidden or tuple(ids.shape) != (T, kernel.top_k) or \
            ids.shape != weights.shape or ids.dtype.is_floating_point:
        raise ValueError(f"{kernel.name}: expected x [T, {kernel.hidden}] and integer top_k_index / top_k_weights "
                         f"[T, {kernel.top_k}], got {tuple(x.shape)}, {tuple(ids.shape)} {ids.dtype}, "
                         f"{tuple(weights.shape)}")


def _ring(kernel, staging: HostStaging, call, stream, device: torch.device, tokens: int, dtype: torch.dtype):
    """Start the CPU call from `stream` (its doorbell, else a host function); a function that
    enqueues the wait for it on the same stream."""
    ext = kernel.runtime.ext
    if staging.handoff(device) == "doorbell":
        ring, done = staging.device_flags(kernel)
        stream_write_value(stream, ring, staging.number(kernel, tokens, dtype))  # (fenced: the copies land first)
        staging.wake()

        def wait_bell() -> None:
            stream_wait_value(stream, done, 1)
            stream_write_value(stream, done, 0)
        return wait_bell
    launch_host_func(ext.moe_host_submit, call.address, stream)
    return lambda: launch_host_func(ext.moe_host_wait, call.address, stream)


def _copy_back(yp: torch.Tensor, device: torch.device, out_dtype: torch.dtype, read_back: bool, extra,
               epilogue: MoEEpilogue | None) -> torch.Tensor:
    """y from the pinned buffer onto the GPU (+ `extra`, the GPU's share): by one kernel reading
    it (`read_back`), which also does the epilogue where given, else by a copy."""
    if not read_back:
        y = yp.to(device, non_blocking=True)
        return (y if extra is None else y.float() + extra).to(out_dtype)
    from .triton.handoff import copy_rows, copy_rows_add_norm
    if epilogue is not None:
        epilogue.result = copy_rows_add_norm(yp, epilogue.residual.view(yp.shape), epilogue.weight, epilogue.eps,
                                             out_dtype, add=extra)
        return epilogue.result[0]
    y = torch.empty(yp.shape, device=device, dtype=out_dtype)
    copy_rows(yp, y, add=extra)  # one kernel reading the pinned buffer
    return y
