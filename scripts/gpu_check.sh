#!/usr/bin/env bash
# On the GPU machine (device tool): build the C++ extension, run the whole test suite (GPU tests
# included once they exist), and the CPU-kernel benchmark with kt-kernel beside it. Results go
# to $OUT. Carry `.whl`, made here once (it is git-ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp #       --platform manylinux_2_35_x86_64 -d /tmp/ktk kt-kernel==0.7.2
#   unzip -q /tmp/ktk/kt_kernel-*.whl -d /tmp/ktk/x && mkdir -p .whl/site && cp -r /tmp/ktk/x/kt_kernel \
#       /tmp/ktk/x/kt_kernel.libs /tmp/ktk/x/kt_kernel-0.7.2.dist-info .whl/site/ && \
#       rm -rf .whl/site/kt_kernel/_kt_kernel_ext_avx* .whl/site/kt_kernel/cli .whl/site/kt_kernel/sft
# (cpufeature has no cp312 wheel; the kernels then read /proc/cpuinfo.)
#   device run: bash scripts/gpu_check.sh   (env: THREADS, FORMATS, SHAPES, BENCH_ARGS)
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  echo "cores: $(nproc)"; grep -m1 "model name" /proc/cpuinfo
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/machine.txt"
python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
python3 -c "from ktransformers.kernels.cpu import supported_isas, default_isa; print('ISA levels:', supported_isas(), 'default:', default_isa())" | tee -a "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -15
THREADS=${THREADS:-14}
python3 -m ktransformers.bench.moe --threads "$THREADS" --peer-threads "$THREADS" --copies 2 \
    --formats ${FORMATS:-Q4_K_M Q8_0 BF16} --shapes ${SHAPES:-qwen3 deepseek} ${BENCH_ARGS:-} 2>"$OUT/bench_moe.err" | tee "$OUT/bench_moe.txt"
