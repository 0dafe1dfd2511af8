#!/usr/bin/env bash
# On the GPU machine (device tool): build the C++ extension, run the whole test suite (GPU tests
# included once they exist), and the CPU-kernel benchmark with kt-kernel beside it. Results go
# to $OUT. Carry `.whl` (gguf wheel; kt_kernel's cp312 files under .whl/site).
#   device run: bash scripts/gpu_check.sh
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
