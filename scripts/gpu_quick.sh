#!/usr/bin/env bash
# A GPU check that fits a short lease (at most 8 minutes of a 15-minute device budget): the decode
# table of every method, eager, captured (+graph) and compiled (+compile), at batch 1 and 8, 32k, 10%,
# against stock eager and StaticCache + compile, measured in one process by benchmarks/bench_gpu_steps.py
# and written as markdown to $OUT/decode_steps_<commit>.md (its rows as JSON lines beside it).
#
# Budget (the whole run within 8 minutes on an H100/H200):
#   ~15 s    imports and the CUDA check
#   ~20 s    the model (LAYERS=3 of the Llama-3-8B shape; the bandwidth bound is computed for the same
#            layers) and the copy bandwidth
#   STEPS_S  rows of the table (default 330 s): first every eager and captured row (one prefill per
#            method and batch, 16 steps each: ~1-3 s a row), then the compiled rows (StaticCache, then each
#            method; tens of seconds each); rows that no longer fit are marked skipped, and the section
#            ends within STEPS_S plus one compiled row (~60 s): under 7 minutes in all.
#
#   METHODS   kvhive methods (default: every one); BATCHES (1,8); CONTEXT (32768); LAYERS (3); DECODE_STEPS (16)
#   OUT       where the table, the JSON lines and the logs go (default results/gpu)
#   --dry-run the same section on the CPU with kvhive's tiny model (no GPU needed; +graph rows are n/a,
#             +compile uses aot_eager): checks that the script runs end to end, e.g. before a lease.
#
# Optional sections, off by default (each adds its own time to the 8 minutes; set the variable to run it):
#   CONFIGS     benchmarks/bench_gpu.py rows at 32k batch 1, each in a fresh process (peak memory valid),
#               e.g. CONFIGS=stock-cudnn-off,snapkv+graph,tova+compile; CONFIG_S seconds each (90), BENCH_S in all (300)
#   BATCH8      the same at batch 8 (BENCH8_S); PROFILE: configurations to profile (torch.profiler)
#   PREFILL8K   configurations whose 8k prefill runs with SubGen's kernel and its compiled step (e.g. full,subgen)
#   PREFILL32K  configurations whose 32k prefill runs (e.g. full,bumblebee)
#   PADDED8K    configurations whose 8k prefill runs on a left-padded batch of 2 (e.g. full,h2o)
#   TESTS_S     seconds for tests_gpu on 8 workers (~40 s; 0, the default, skips them)
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
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
if [ "$DRY_RUN" = 1 ]; then
  "$PYTHON" -c "import torch, transformers, kvhive; print(torch.__version__, transformers.__version__, 'CPU dry run')" || exit 4
  timeout "${STEPS_S:-330}" "$PYTHON" benchmarks/bench_gpu_steps.py --device cpu --tiny --batches "${BATCHES:-1,2}" \
    --steps 2 --budget-s "$(( ${STEPS_S:-330} / 2 ))" ${METHODS:+--methods "$METHODS"} \
    --out "$OUT/decode_steps_dry_run_$KVHIVE_COMMIT.jsonl" --table "$OUT/decode_steps_dry_run_$KVHIVE_COMMIT.md"
  exit $?
fi
"$PYTHON" -c "import torch, transformers, triton, kvhive; assert torch.cuda.is_available(), 'needs a CUDA GPU'; \
print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" || exit 4
STEPS_S=${STEPS_S:-330}
echo "== bench_gpu_steps.py: eager, +graph, +compile, batches ${BATCHES:-1,8}, ${STEPS_S} s of rows"
# The hard limit: the rows' budget, one compiled row over it, and the model build.
timeout "$(( STEPS_S + 90 ))" "$PYTHON" benchmarks/bench_gpu_steps.py --context "${CONTEXT:-32768}" \
  --batches "${BATCHES:-1,8}" --layers "${LAYERS:-3}" --steps "${DECODE_STEPS:-16}" --budget-s "$STEPS_S" \
  ${METHODS:+--methods "$METHODS"} --out "$OUT/decode_steps_$KVHIVE_COMMIT.jsonl" \
  --table "$OUT/decode_steps_$KVHIVE_COMMIT.md"
echo "bench_gpu_steps exit $?"
CONFIGS=${CONFIGS-}
if [ -n "$CONFIGS" ]; then
  echo "== bench_gpu.py: $CONFIGS"
  timeout "${BENCH_S:-300}" "$PYTHON" benchmarks/bench_gpu.py --context "${CONTEXT:-32768}" --batch 1 \
    --decode-tokens 16 --timeout "${CONFIG_S:-90}" --configs "$CONFIGS" ${PROFILE:+--profile "$PROFILE"} \
    --out "$OUT/bench_gpu_quick.jsonl"
fi
BATCH8=${BATCH8-}
if [ -n "$BATCH8" ]; then
  echo "== bench_gpu.py, batch 8: $BATCH8"
  timeout "${BENCH8_S:-300}" "$PYTHON" benchmarks/bench_gpu.py --context "${CONTEXT:-32768}" --batch 8 \
    --decode-tokens 16 --timeout "${CONFIG_S:-90}" --configs "$BATCH8" --out "$OUT/bench_gpu_quick_b8.jsonl"
fi
# Issue 25: SubGen's prefill at 8k, its Triton pick (auto) against its compiled torch step
# (compiled), with the full cache's prefill beside them (off by default: PREFILL8K=full,subgen).
PREFILL8K=${PREFILL8K-}
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
# sums from flash attention row by row, beside the full cache's (off by default: PADDED8K=full,h2o; ~1 minute).
PADDED8K=${PADDED8K-}
if [ -n "$PADDED8K" ]; then
  echo "== bench_gpu.py, prefill 8k, batch 2, left padding 1024: $PADDED8K"
  timeout "${PADDED_S:-150}" "$PYTHON" benchmarks/bench_gpu.py --context 8192 --batch 2 --left-padding 1024 \
    --decode-tokens 4 --timeout "${CONFIG_S:-90}" --configs "$PADDED8K" --out "$OUT/bench_gpu_quick_padded8k.jsonl"
fi
if [ "${TESTS_S:-0}" != 0 ]; then
  echo "== tests_gpu"
  timeout "${TESTS_S}" "$PYTHON" -m pytest -q -n 8 -p no:cacheprovider --timeout 150 -rf tests_gpu \
    > "$OUT/tests_gpu_$KVHIVE_COMMIT.txt" 2>&1
  echo "pytest exit $?"
  tail -40 "$OUT/tests_gpu_$KVHIVE_COMMIT.txt"
fi
