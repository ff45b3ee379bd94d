#!/usr/bin/env bash
# A GPU check that fits a short lease (about 8 minutes of a 15-minute device budget; the eighth
# session's four calls on an H200 used this): decode rows at 32k batch 1 of the configurations
# named, each in a fresh process with a per-configuration limit, then tests_gpu on 8 workers
# (~40 s). scripts/gpu_run.sh is the full run (hours); this is its smallest useful part.
#
#   CONFIGS   bench_gpu.py configurations (default: stock eager, SnapKV eager and captured, the
#             captured step of the decode-evicting methods, and compiled rows: on the images' torch
#             2.11 kvhive's compiled step runs inside kvhive.compression, see kvhive/static_step.py)
#   CONTEXT / BATCH   prompt tokens (32768) and rows (1); BATCH8: configurations also run at batch 8;
#             PREFILL8K: configurations whose 8k prefill runs with SubGen's kernel and its compiled step;
#             PREFILL32K: configurations whose 32k prefill runs (none by default; "full,bumblebee");
#             PADDED8K: configurations whose 8k prefill runs on a left-padded batch of 2 (full,h2o)
#   BENCH_S / CONFIG_S / TESTS_S   seconds for the whole bench, one configuration, tests_gpu
#             (TESTS_S=0 skips the tests); PROFILE: configurations to profile (torch.profiler)
#   OUT       where the JSON lines and the test log go (default results/gpu)
#
# On a device image whose transformers is older than pyproject's floor, carry wheels: here, in the
# repository root, `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_17_x86_64 -d .whl transformers==<the version .venv has> regex==<.venv's>` (.whl/ is
# git-ignored locally); this script installs what .whl/ holds into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export KVHIVE_COMMIT=${KVHIVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
"$PYTHON" -c "import torch, transformers, triton, kvhive; assert torch.cuda.is_available(), 'needs a CUDA GPU'; \
print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" || exit 4
CONFIGS=${CONFIGS:-stock-cudnn-off,snapkv,snapkv+graph,tova+graph,streamingllm+graph,h2o+graph,ahakv+graph,buzz+graph,subgen+graph,full+graph,stock-static+compile,snapkv+compile,tova+compile,buzz+compile}
echo "== bench_gpu.py: $CONFIGS"
timeout "${BENCH_S:-300}" "$PYTHON" benchmarks/bench_gpu.py --context "${CONTEXT:-32768}" --batch "${BATCH:-1}" \
  --decode-tokens 16 --timeout "${CONFIG_S:-90}" --configs "$CONFIGS" ${PROFILE:+--profile "$PROFILE"} \
  --out "$OUT/bench_gpu_quick.jsonl"
# Issue 23's batch-8 target (bandwidth efficiency >= 0.5): a few captured steps at batch 8 (BATCH8=""
# skips them).
BATCH8=${BATCH8-stock-cudnn-off,snapkv+graph,tova+graph,buzz+graph}
if [ -n "$BATCH8" ]; then
  echo "== bench_gpu.py, batch 8: $BATCH8"
  timeout "${BENCH8_S:-300}" "$PYTHON" benchmarks/bench_gpu.py --context "${CONTEXT:-32768}" --batch 8 \
    --decode-tokens 16 --timeout "${CONFIG_S:-90}" --configs "$BATCH8" --out "$OUT/bench_gpu_quick_b8.jsonl"
fi
# Issue 25: SubGen's prefill at 8k, its Triton pick (auto) against its compiled torch step
# (compiled), with the full cache's prefill beside them (PREFILL8K="" skips them).
PREFILL8K=${PREFILL8K-full,subgen}
if [ -n "$PREFILL8K" ]; then
  for path in auto compiled; do
    echo "== bench_gpu.py, prefill 8k, --prefill-path $path: $PREFILL8K"
    timeout "${PREFILL_S:-150}" "$PYTHON" benchmarks/bench_gpu.py --context 8192 --batch 1 --decode-tokens 4 \
      --timeout "${CONFIG_S:-90}" --configs "$PREFILL8K" --prefill-path "$path" --out "$OUT/bench_gpu_quick_prefill8k.jsonl"
  done
fi
# Issue 25: BumbleBee's prefill at 32k (PREFILL32K="full,bumblebee" runs it; off by default: its
# first prefill compiles the greedy step's gain buckets, minutes of a short lease). Before the
# device-sized chunks of b05e7cb it timed out at 120 s.
PREFILL32K=${PREFILL32K-}
if [ -n "$PREFILL32K" ]; then
  echo "== bench_gpu.py, prefill 32k: $PREFILL32K"
  timeout "${PREFILL32K_S:-400}" "$PYTHON" benchmarks/bench_gpu.py --context 32768 --batch 1 --decode-tokens 4 \
    --timeout "${CONFIG32K_S:-300}" --configs "$PREFILL32K" --out "$OUT/bench_gpu_quick_prefill32k.jsonl"
fi
# Issue 25: a left-padded batch's prefill (rows 1, 3, ... of 2 padded by 1,024 tokens): its column
# sums from flash attention row by row, beside the full cache's (PADDED8K="" skips them; ~1 minute).
PADDED8K=${PADDED8K-full,h2o}
if [ -n "$PADDED8K" ]; then
  echo "== bench_gpu.py, prefill 8k, batch 2, left padding 1024: $PADDED8K"
  timeout "${PADDED_S:-150}" "$PYTHON" benchmarks/bench_gpu.py --context 8192 --batch 2 --left-padding 1024 \
    --decode-tokens 4 --timeout "${CONFIG_S:-90}" --configs "$PADDED8K" --out "$OUT/bench_gpu_quick_padded8k.jsonl"
fi
if [ "${TESTS_S:-200}" != 0 ]; then
  echo "== tests_gpu"
  timeout "${TESTS_S:-200}" "$PYTHON" -m pytest -q -n 8 -p no:cacheprovider --timeout 150 -rf tests_gpu \
    > "$OUT/tests_gpu_$KVHIVE_COMMIT.txt" 2>&1
  echo "pytest exit $?"
  tail -40 "$OUT/tests_gpu_$KVHIVE_COMMIT.txt"
fi
