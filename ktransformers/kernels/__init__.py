"""kernels: the compute below the operators: the C++ CPU kernels' Python face (`cpu`), CPU
experts run in order with a GPU stream (`cuda_host`) and the Triton GPU kernels (`triton`)."""
