#!/usr/bin/env bash
# On a CUDA machine: the hybrid end-to-end benchmark (bench.e2e) of synthetic files (default: the
# 48-layer Qwen3-30B-A3B shape, Q4_K_M) beside llama.cpp's CUDA build with its experts on the CPU,
# and the hand-off benchmark (bench.handoff, doorbell and host hand-offs). Two parts, run one after
# the other on the same machine (the second reuses the first's llama-bench build and model files in
# /tmp); needs .whl/ (the Python wheels) and .peer/llama.tar.gz in the working directory. The
# tarball is llama.cpp as llama-cpp-python 0.3.36's sdist vendors it, without the other GPU
# backends (about 8 MB), made once on a machine with network access:
#   mkdir -p .peer /tmp/lsrc   (.peer/ is git-ignored)
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lsrc
#   tar xzf /tmp/lsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/lsrc
#   ln -sfn /tmp/lsrc/llama_cpp_python-0.3.36/vendor/llama.cpp /tmp/lsrc/llama.cpp
#   tar czhf .peer/llama.tar.gz -C /tmp/lsrc --exclude='ggml/src/ggml-'{blas,cann,et,hexagon,hip,metal,musa,opencl,openvino,rpc,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn} \
#       --exclude='tools/server/public*' llama.cpp/{CMakeLists.txt,cmake,ggml,src,include,common,vendor,tools,app,licenses}
# MODELS names the files, each PRESET[:LAYERS[:TYPE]] of bench.synth (default "qwen3-30b-a3b:48";
# the hybrid table's others: "gpt-oss-120b:8:MXFP4_MOE glm-4.5-air:8"), written as
# /tmp/PRESET-LAYERS.gguf (32k vocabulary for qwen3-30b-a3b, the preset's own for the others).
#   1) PART=prep  bash scripts/gpu_e2e.sh   starts building llama-bench from .peer/llama.tar.gz,
#      builds ours, writes the files, runs the CUDA hand-off tests meanwhile (TESTS=0: not), then,
#      the build done, bench.handoff.
#   2) PART=bench bash scripts/gpu_e2e.sh   bench.e2e of each file with llama-bench beside it (E2E_ARGS:
#      more flags, e.g. "--prompts 512 8192"), then on the first file decode at the
#      thread counts of THREAD_SWEEP (e.g. "15 16"); SAMPLED=1: also a sampled decode
#      (temperature 0.7, top_p 0.9).
# PART=all runs both in one go (HANDOFF=0 leaves bench.handoff out; TEST_FILES, TEST_MARK pick the
# tests run while llama.cpp builds; NO_LLAMA=1: no llama.cpp build, no peer row). In prep, also
# while llama.cpp builds: BENCH_GPU=1 runs bench.gpu, PROFILE=1 dev/gpu_profile.py on a 4-layer file (its kernels),
# STAGING=1 dev/gpu_staging.py (layer-wise prefill's copy and dequantize rates). Those share the
# CPU with llama.cpp's build (-j16): their CPU-side rates read low there (a quiet run: NO_LLAMA=1).
# After the build: FOOTPRINT=1 runs dev/cpu_footprint.py (T=1 over 48 copies of the layer, 4 KiB
# and huge pages, the tasks' reads alone; FOOTPRINT_ARGS, e.g. "16 48 48"; SWEEP=1 its sweep), then
# BENCH_MOE="16 14" runs bench.moe's Qwen3 Q4_K_M layer at those thread counts (MOE_ARGS: its other
# flags; default T=1, no peer).
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-14}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
LLAMA=/tmp/llama/llama.cpp/build/bin/llama-bench
MODELS=${MODELS:-qwen3-30b-a3b:48}
gguf_of() { IFS=: read -r preset layers _ <<< "$1"; echo "/tmp/$preset-${layers:-all}.gguf"; }
FIRST=$(gguf_of "${MODELS%% *}")
PART=${PART:-prep}
if [ "$PART" = prep ] || [ "$PART" = all ]; then
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
  [ "${NO_LLAMA:-0}" = 1 ] || { mkdir -p /tmp/llama && tar xzf .peer/llama.tar.gz -C /tmp/llama; }
  [ "${NO_LLAMA:-0}" = 1 ] || setsid bash -c 'cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/llama_cmake.log 2>&1 \
      && cmake --build build -j16 --target llama-bench > /tmp/llama_build.log 2>&1; echo "llama build rc $?" > /tmp/llama_done' &
  python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  for m in $MODELS; do  # one after the other (each writes at the disk's rate), beside the tests
    IFS=: read -r preset layers type <<< "$m"
    f=$(gguf_of "$m"); [ -f "$f" ] && continue
    python3 -m ktransformers.bench.synth --model "$preset" ${layers:+--layers "$layers"} ${type:+--type "$type"} \
        $([ "$preset" = qwen3-30b-a3b ] && echo --vocab 32000) --out "$f" >> "$OUT/synth.txt" 2>&1
  done &
  SYNTH=$!
  if [ "${TESTS:-1}" != 0 ]; then
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m "${TEST_MARK:-gpu or triton}" \
        ${TEST_FILES:-tests/test_cuda_host.py tests/test_gpu_rules.py} \
        2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
  fi
  if [ "${BENCH_GPU:-0}" = 1 ]; then
    python3 -m ktransformers.bench.gpu 2>"$OUT/bench_gpu.err" | tee "$OUT/bench_gpu.txt"; tail -3 "$OUT/bench_gpu.err"
  fi
  if [ "${STAGING:-0}" = 1 ]; then  # layer-wise prefill's steps, one layer's bytes (needs the 48-layer file)
    wait "$SYNTH"
    python3 dev/gpu_staging.py "$FIRST" "$THREADS" 2>&1 | grep -v Warn | tee "$OUT/staging.txt"
  fi
  if [ "${PROFILE:-0}" = 1 ]; then
    python3 -m ktransformers.bench.synth --model qwen3-30b-a3b --layers 4 --vocab 32000 --out /tmp/q3-4.gguf > /dev/null
    python3 dev/gpu_profile.py /tmp/q3-4.gguf "$THREADS" 2>&1 | grep -v Warn | tee "$OUT/profile.txt" | head -40
  fi
  wait
  if [ "${NO_LLAMA:-0}" != 1 ]; then
    for _ in $(seq 120); do [ -f /tmp/llama_done ] && break; sleep 5; done
    cat /tmp/llama_done; tail -2 /tmp/llama_build.log; ls -la "$LLAMA"
  fi
  tail -n "$(wc -w <<< "$MODELS")" "$OUT/synth.txt"
  sync  # the model file's dirty pages written back now, not while the CPU experts stream (they would slow it)
  if [ "${FOOTPRINT:-0}" = 1 ]; then
    python3 dev/cpu_footprint.py ${FOOTPRINT_ARGS:-$THREADS 48 2 48} 2>&1 | grep -v Warn | tee "$OUT/footprint.txt"
  fi
  for t in ${BENCH_MOE:-}; do  # bench.moe at these thread counts (after the build and synth)
    python3 -m ktransformers.bench.moe --threads "$t" --peer-threads 14 --shapes qwen3 --formats Q4_K_M \
        ${MOE_ARGS:---tokens 1 --no-peer} 2>>"$OUT/bench_moe.err" | tee -a "$OUT/bench_moe.txt"
  done
  if [ "${HANDOFF:-1}" != 0 ]; then
    python3 -m ktransformers.bench.handoff --threads "$THREADS" ${HANDOFF_ARGS:-} 2>"$OUT/handoff.err" | tee "$OUT/handoff.txt"
    tail -3 "$OUT/handoff.err"
  fi
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  PEER=(--llama-bench "$LLAMA")
  [ "${NO_LLAMA:-0}" = 1 ] && PEER=()
  [ "${NO_LLAMA:-0}" = 1 ] || [ -f "$LLAMA" ] || { echo "no llama-bench: run PART=prep first"; exit 1; }
  [ "$PART" = bench ] && { python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }; }
  for m in $MODELS; do
    python3 -m ktransformers.bench.e2e --gguf_path "$(gguf_of "$m")" --threads "$THREADS" --repeats 1 --decode 64 \
        "${PEER[@]}" ${E2E_ARGS:-} 2>>"$OUT/e2e.err" | tee -a "$OUT/e2e.txt"
  done
  tail -3 "$OUT/e2e.err"
  for t in ${THREAD_SWEEP:-}; do  # decode at other thread counts (ours only)
    echo "# --threads $t" | tee -a "$OUT/e2e.txt"
    python3 -m ktransformers.bench.e2e --gguf_path "$FIRST" --threads "$t" --repeats 1 --decode 64 --prompts 512 \
        2>>"$OUT/e2e.err" | tee -a "$OUT/e2e.txt"
  done
  if [ "${SAMPLED:-0}" = 1 ]; then  # decode sampled tokens (temperature 0.7, top_p 0.9)
    echo "# sampled" | tee -a "$OUT/e2e.txt"
    python3 -m ktransformers.bench.e2e --gguf_path "$FIRST" --threads "$THREADS" \
        --repeats 1 --decode 64 --prompts 512 --temperature 0.7 --top_p 0.9 2>>"$OUT/e2e.err" | tee -a "$OUT/e2e.txt"
  fi
fi
