#!/usr/bin/env bash
# On the GPU machine: layer-wise prefill checked and timed. Builds the extension, runs its GPU tests (both
# paths, groups, the tile dequantization) while a 48-layer Qwen3-30B-A3B-shaped Q4_K_M file is written, then
# bench.e2e at 2048/8192 prompt tokens (PROMPTS) reading the experts from the CPU tiles in place (the default where
# they exist), then at 8192 (STAGED_PROMPTS) with the GGUF bytes staged through pinned chunks (E2E=0 skips
# both); with PROGRAMS (e.g. "0,264,528"), dev/gpu_tiles_programs.py times the tiles' path by the cap on
# the dequantizing kernel's programs, the caps taking turns in one process. Carry [".whl"].
set -o pipefail; export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; date -u
python3 setup.py -q build_ext --inplace > /tmp/build.txt 2>&1 || tail -20 /tmp/build.txt
python3 -m ktransformers.bench.synth --model qwen3-30b-a3b --vocab 32000 --out /tmp/q3-48.gguf > /tmp/synth.txt 2>&1 &
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/test_cuda_host.py tests/test_pcie_experts.py tests/test_triton_kernels.py -k "${TEST_K:-layerwise or dequantize_tiles or groups}" 2>&1 | tail -6
wait; tail -1 /tmp/synth.txt; sync; date -u
if [ -n "$PROGRAMS" ]; then
  python3 dev/gpu_tiles_programs.py /tmp/q3-48.gguf "$PROGRAMS" 2048,8192 ${ROUNDS:-3} 2>&1 | grep -v -i "loading\|warn"
  date -u
fi
[ "${E2E:-1}" = 0 ] && exit 0
E2E="--gguf_path /tmp/q3-48.gguf --threads 14 --decode 8 --repeats 1"
python3 -m ktransformers.bench.e2e $E2E --prompts ${PROMPTS:-2048 8192} 2>/dev/null | grep -v loading | head -3
echo "# staged"
python3 -c "import sys; from ktransformers.operators.experts import LayerwisePrefill as L; L._tiles = lambda self, op: None; from ktransformers.bench.e2e import main; main(sys.argv[1:])" $E2E --prompts ${STAGED_PROMPTS:-8192} 2>/dev/null | grep -v loading | head -3
date -u
