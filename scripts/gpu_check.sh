#!/usr/bin/env bash
# On a CUDA machine: build the C++ extension, run the tests (the Triton/GPU ones first), the GPU
# kernel benchmark, the CPU-kernel benchmark with kt-kernel beside it, and an end-to-end decode
# benchmark of the GPU rule file. Results go to $OUT. Needs `.whl/` in the working directory,
# made once on a machine with network access (git-ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_35_x86_64 -d /tmp/ktk kt-kernel==0.7.2
#   unzip -q /tmp/ktk/kt_kernel-*.whl -d /tmp/ktk/x && mkdir -p .whl/site && cp -r /tmp/ktk/x/kt_kernel \
#       /tmp/ktk/x/kt_kernel.libs /tmp/ktk/x/kt_kernel-0.7.2.dist-info .whl/site/ && \
#       rm -rf .whl/site/kt_kernel/_kt_kernel_ext_avx* .whl/site/kt_kernel/cli .whl/site/kt_kernel/sft
# (cpufeature has no cp312 wheel; the kernels then read /proc/cpuinfo.)
#   run: bash scripts/gpu_check.sh
#   env: STEPS (default "gpu-tests tests bench-gpu bench-moe e2e"), THREADS, FORMATS, SHAPES,
#        BENCH_ARGS (bench.moe), E2E_LAYERS (synthetic Qwen3-30B-A3B layers for e2e, default 4)
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-gpu-tests tests bench-gpu bench-moe e2e}
THREADS=${THREADS:-14}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  echo "cores: $(nproc)"; grep -m1 "model name" /proc/cpuinfo
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} | tee "$OUT/machine.txt"
python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
python3 -c "from ktransformers.kernels.cpu import supported_isas, default_isa; print('ISA levels:', supported_isas(), 'default:', default_isa())" | tee -a "$OUT/machine.txt"
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has gpu-tests; then
  python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
fi
if has tests; then
  python3 -m pytest -q -p no:cacheprovider -m "not gpu and not triton" 2>&1 | tee "$OUT/pytest.txt" | tail -15
fi
if has bench-gpu; then
  python3 -m ktransformers.bench.gpu 2>"$OUT/bench_gpu.err" | tee "$OUT/bench_gpu.txt"; tail -5 "$OUT/bench_gpu.err"
fi
if has bench-moe; then
  python3 -m ktransformers.bench.moe --threads "$THREADS" --peer-threads "$THREADS" --copies 2 \
      --formats ${FORMATS:-Q4_K_M Q8_0 BF16} --shapes ${SHAPES:-qwen3 deepseek} ${BENCH_ARGS:-} 2>"$OUT/bench_moe.err" | tee "$OUT/bench_moe.txt"
fi
if has e2e; then
  python3 -m ktransformers.bench.synth --model qwen3-30b-a3b --layers "${E2E_LAYERS:-4}" --vocab 32000 --out /tmp/q3.gguf > /dev/null
  for variant in "--device cuda" "--device cuda --no-cuda-graph" "--device cpu"; do
    echo "# bench.decode $variant" | tee -a "$OUT/bench_decode.txt"
    python3 -m ktransformers.bench.decode --gguf_path /tmp/q3.gguf $variant --threads "$THREADS" --no-peer \
        --prompt 512 --decode 64 2>>"$OUT/bench_decode.err" | tee -a "$OUT/bench_decode.txt"
  done
fi
