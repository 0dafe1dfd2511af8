#!/usr/bin/env bash
# On the GPU machine: the hybrid end-to-end benchmark (bench.e2e) of a 48-layer Qwen3-30B-A3B-shaped
# Q4_K_M file beside llama.cpp's CUDA build with its experts on the CPU. Two device calls on one
# warm machine (it is released after ~30 s idle, so issue the second at once):
#   1) PART=build  bash scripts/gpu_e2e.sh   builds llama-bench from .peer/llama.tar.gz (~5 min,
#      the vendored llama.cpp of llama-cpp-python 0.3.36's sdist, see ../shared/PEERS.md) and writes
#      /tmp/q3-48.gguf; carry [".whl", ".peer"].
#   2) PART=bench  bash scripts/gpu_e2e.sh   runs bench.e2e with llama-bench beside it.
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-16}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
if [ "${PART:-build}" = build ]; then
  mkdir -p /tmp/llama && tar xzf .peer/llama.tar.gz -C /tmp/llama
  ( cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/llama_cmake.log 2>&1 \
      && cmake --build build -j16 --target llama-bench > /tmp/llama_build.log 2>&1; echo "llama build rc $?" >> /tmp/llama_build.log ) &
  python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  python3 -m ktransformers.bench.synth --model qwen3-30b-a3b --vocab 32000 --out /tmp/q3-48.gguf | tail -2
  [ -n "${TESTS:-}" ] && python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -8
  wait
  tail -3 /tmp/llama_build.log; tail -3 /tmp/llama_cmake.log
  ls -la /tmp/llama/llama.cpp/build/bin/ 2>&1 | tail -3
else
  python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  python3 -m ktransformers.bench.e2e --gguf_path /tmp/q3-48.gguf --threads "$THREADS" \
      --llama-bench /tmp/llama/llama.cpp/build/bin/llama-bench ${E2E_ARGS:-} 2>"$OUT/e2e.err" | tee "$OUT/e2e.txt"
  tail -5 "$OUT/e2e.err"
fi
