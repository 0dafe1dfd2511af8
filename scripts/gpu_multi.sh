#!/usr/bin/env bash
# On a CUDA machine with two GPUs: the GPU tests with the multi-GPU ones
# (tests/test_multi_gpu.py: a tiny model split over both GPUs equals one GPU; graph segments equal
# eager), then bench.e2e of a DeepSeek-V3-shaped synthetic Q4_K_M file on one GPU (beside
# llama.cpp, experts on the CPU) and split over both by the planner's rule file. Two parts, run
# one after the other on the same machine (the second reuses the first's builds in /tmp); needs
# .whl/ (as scripts/gpu_check.sh makes it) and .peer/llama.tar.gz in the working directory:
#   1) PART=tests bash scripts/gpu_multi.sh   build, tests; llama-bench and /tmp/ds.gguf built meanwhile
#   2) PART=bench bash scripts/gpu_multi.sh   the benchmarks
#   env: THREADS (CPU expert threads, default 28), DS_LAYERS (default 8: 3 dense + 5 MoE layers),
#        GPU_BUDGET (per GPU for the planner, default 24GiB; GPU_BUDGET_ONE 48GiB for the one-GPU
#        comparison), PROMPTS, LAYERWISE (prefill_gpu_threshold of the one-GPU run, default 4096)
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
THREADS=${THREADS:-28}
LLAMA=/tmp/llama/llama.cpp/build/bin/llama-bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
if [ "${PART:-tests}" = tests ]; then
  {
    date -u
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -4
    echo "cores: $(nproc)"; grep -m1 "model name" /proc/cpuinfo; lscpu | grep -i "numa node\|socket"
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  } | tee "$OUT/machine.txt"
  mkdir -p /tmp/llama && tar xzf .peer/llama.tar.gz -C /tmp/llama
  ( cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/llama_cmake.log 2>&1 \
      && cmake --build build -j12 --target llama-bench > /tmp/llama_build.log 2>&1; echo "llama build rc $?" >> /tmp/llama_build.log ) &
  python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  python3 -m ktransformers.bench.synth --model deepseek-v3 --layers "${DS_LAYERS:-8}" --out /tmp/ds.gguf > "$OUT/synth.txt" 2>&1 &
  python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
  wait
  tail -2 /tmp/llama_build.log; tail -2 "$OUT/synth.txt"; ls -la "$LLAMA" /tmp/ds.gguf
else
  python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  python3 -m ktransformers.optimize.planner --gguf_path /tmp/ds.gguf --gpu_memory "0:${GPU_BUDGET:-24GiB},1:${GPU_BUDGET:-24GiB}" \
      --cache_lens 9000 --out /tmp/ds-2gpu.yaml | tee "$OUT/planner.txt"
  echo "# one GPU, shipped rules, llama.cpp beside" | tee "$OUT/e2e.txt"
  python3 -m ktransformers.bench.e2e --gguf_path /tmp/ds.gguf --threads "$THREADS" --prompts ${PROMPTS:-512 2048 8192} \
      --prefill_gpu_threshold "${LAYERWISE:-4096}" --extrapolate 61 --decode 64 --llama-bench "$LLAMA" 2>"$OUT/e2e.err" | tee -a "$OUT/e2e.txt"
  tail -5 "$OUT/e2e.err"
  echo "# two GPUs, the planner's rules (GPU budget ${GPU_BUDGET:-24GiB} each, hot experts)" | tee -a "$OUT/e2e.txt"
  python3 -m ktransformers.bench.e2e --gguf_path /tmp/ds.gguf --optimize_config_path /tmp/ds-2gpu.yaml --threads "$THREADS" \
      --prompts 512 2048 --prefill_gpu_threshold 0 --extrapolate 61 --decode 64 2>"$OUT/e2e2.err" | tee -a "$OUT/e2e.txt"
  tail -5 "$OUT/e2e2.err"
  echo "# one GPU with both budgets (the planner's rules for one GPU of twice the budget)" | tee -a "$OUT/e2e.txt"
  python3 -m ktransformers.optimize.planner --gguf_path /tmp/ds.gguf --gpu_memory "0:${GPU_BUDGET_ONE:-48GiB}" \
      --cache_lens 9000 --out /tmp/ds-1gpu.yaml | tee -a "$OUT/planner.txt"
  python3 -m ktransformers.bench.e2e --gguf_path /tmp/ds.gguf --optimize_config_path /tmp/ds-1gpu.yaml --threads "$THREADS" \
      --prompts 512 2048 --prefill_gpu_threshold 0 --extrapolate 61 --decode 64 2>"$OUT/e2e1.err" | tee -a "$OUT/e2e.txt"
  tail -5 "$OUT/e2e1.err"
fi
