"""RunContext: what the operators of one loaded model share, owned by the model (not a module
global): the CPU runtime (thread pool), the staging that runs CPU experts from GPU streams, the
measured read rates the bus share's cost model weighs, and, set by the engine around each
forward, the KV cache and the step's ForwardBatch that attention operators read and write. With
no batch set, attention runs cache-free over its input (plain HF-style `model(input_ids)` calls)."""
from __future__ import annotations

import torch


class RunContext:
    def __init__(self, cpu_threads: int | None = None, cpu_tiles: bool = True):
        self.cpu_threads = cpu_threads
        # the CPU kernels' weights repacked into 16-row tiles (RAM copies, faster) or computed on in
        # the mapped file (load_model decides by what fits: optimize.memory.tiles_fit)
        self.cpu_tiles = cpu_tiles
        self._cpu = None
        self._staging = None
        self.pcie_rates: tuple[float, float] | None = None  # (bus, CPU) read rates in GB/s, measured once
        self.cache = None  # a cache.PagedCache
        self.batch = None  # the cache.ForwardBatch of the forward in flight

    def cpu_runtime(self):
        if self._cpu is None:
            from ..kernels.cpu import CPURuntime
            self._cpu = CPURuntime(self.cpu_threads)
        return self._cpu

    def cpu_pool_threads(self) -> int:
        """Threads of the CPU runtime, once it exists (0 before)."""
        return self._cpu.threads if self._cpu is not None else 0

    def host_staging(self):
        """Pinned buffers and host calls that run CPU experts in order with a CUDA stream."""
        if self._staging is None:
            from ..kernels.cuda_host import HostStaging
            self._staging = HostStaging(self.cpu_runtime(), pinned=torch.cuda.is_available())
        return self._staging

    @property
    def staging(self):
        """The host staging where one was made (CPU experts fed from a GPU), else None."""
        return self._staging

    def check_host_errors(self) -> None:
        """Raise what a CPU job run from a CUDA stream failed with (call after the stream ran)."""
        if self._staging is not None:
            self._staging.check_errors()

    def rest_host_calls(self) -> None:
        """The CPU jobs fed from the CUDA streams are done (call after the streams ran): their
        threads stop spinning until the next step wakes them."""
        if self._staging is not None:
            self._staging.rest()
