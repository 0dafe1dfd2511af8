#!/usr/bin/env bash
# On the GPU machine (device tool): bench.moe of the working tree's CPU kernels against a base
# version of some csrc files, in one call, runs interleaved (base, new, base, new ...), so the
# host's memory moods fall on both. Carry [".whl", ".peer"]; put the base files in .peer/base-csrc/
# (e.g. `git show HEAD:csrc/int8.cpp > .peer/base-csrc/int8.cpp`).
#   device run: ROUNDS=2 MOE_ARGS="--tokens 512 --int8" bash dev/cpu_ab.sh
#   env: THREADS (16), ROUNDS (2), ORDER (a round's runs, "base new"), MOE_ARGS (bench.moe's flags besides --threads; default T=512 with
#        the int8 copies, Qwen3 Q4_K_M, no peer), PEER_ARGS (one more run of the new build with these
#        flags after the rounds, e.g. "--peer-amx --peer-threads 14"; empty: none), TESTS (pytest
#        arguments run on the new build first, e.g. "tests/test_cpu_kernels.py -k int8"; empty: none)
set -uo pipefail
OUT=${OUT:-/tmp/kt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-16}
MOE_ARGS=${MOE_ARGS:---tokens 512 --int8 --shapes qwen3 --formats Q4_K_M --no-peer}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
SITE=/tmp/site:$PWD/.whl/site
ls .peer/base-csrc/* > /dev/null || { echo "no base files in .peer/base-csrc"; exit 1; }
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r setup.py pyproject.toml csrc ktransformers /tmp/base/ && cp .peer/base-csrc/* /tmp/base/csrc/
rm -f /tmp/base/ktransformers/kernels/_cpu_*.so  # (the tree's own build, copied with it)
(cd /tmp/base && python3 setup.py -q build_ext --inplace > "$OUT/build_base.txt" 2>&1) &
BASE_BUILD=$!
python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
wait "$BASE_BUILD" || { tail -30 "$OUT/build_base.txt"; exit 1; }
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH=$SITE:$PWD python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/pytest_ab.txt" | tail -8
fi
for round in $(seq "${ROUNDS:-2}"); do
  for side in ${ORDER:-base new}; do
    root=$PWD; [ "$side" = base ] && root=/tmp/base
    echo "# round $round: $side" | tee -a "$OUT/ab.txt"
    (cd "$root" && PYTHONPATH=$SITE:$root python3 -m ktransformers.bench.moe --threads "$THREADS" $MOE_ARGS \
        2>>"$OUT/ab.err" | tee -a "$OUT/ab.txt")
  done
done
if [ -n "${PEER_ARGS:-}" ]; then
  echo "# new, with kt-kernel: $PEER_ARGS" | tee -a "$OUT/ab.txt"
  PYTHONPATH=$SITE:$PWD python3 -m ktransformers.bench.moe --threads "$THREADS" \
      ${MOE_ARGS/--no-peer/} $PEER_ARGS 2>>"$OUT/ab.err" | tee -a "$OUT/ab.txt"
fi
tail -3 "$OUT/ab.err"
