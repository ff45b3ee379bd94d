#!/usr/bin/env bash
# The next GPU run, in one script: what a CPU-only session cannot confirm (issues 23, 24, 25).
# Run on a machine with one CUDA GPU (an H100 80 GB is what the targets name), from the
# repository root, in an environment with a CUDA build of torch and this package installed
# (`pip install -e '.[test]'` after `pip install torch`). Every step appends to results/gpu/ and
# the benchmarks resume where a killed run stopped; STEPS="tests decode" runs a subset.
# A lease of minutes, not hours: scripts/gpu_quick.sh (the decode table, every method eager, +graph and
# +compile at 32k batch 1 and 8 on 3 layers, in under 8 min).
#
#   tests    tests_gpu: a steady decode step of every method under set_sync_debug_mode("error"),
#            a CUDA graph of one decode step replayed 32 times equal to eager, kernels against
#            their references (issue 23 items 2, 3, 6)
#   decode   decode ms/token at 32k, 10%, batch 1/4/8, eager and compiled, stock rows in the same
#            run (issue 23 targets: <= best stock, compiled <= 2x the bandwidth bound, evicting
#            methods <= 1.2x snapkv)
#   prefill  prefill + compression / prefill at 8k and 32k (issue 25 targets)
#   capacity the largest batch at 32k that fits the GPU, full cache vs compressed, prompts fed
#            whole, in chunks, and one row at a time into fixed batch slots (--rows-alone, the
#            serving path of generate_batch); then decode tokens/s at batch 48 in slots, compiled
#            (issue 24: >= 48 requests at 10%, >= 4x the best stock batch's tokens/s)
#   stream   a 1M-token prompt at a 32k budget, chunked, peak memory every 50k tokens (issue 24)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-"tests decode prefill capacity stream"}
OUT=results/gpu
mkdir -p "$OUT"
COMMIT=$(git rev-parse --short HEAD)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -c "import torch; assert torch.cuda.is_available(), 'scripts/gpu_run.sh needs a CUDA GPU'"

EVICTING="tova,h2o,streamingllm,ahakv,buzz,buzz-logn,bumblebee,subgen,subgen-attention,random,local"
PREFILL_ONLY="full,snapkv,pyramidkv,knorm,ada-snapkv,ada-pyramidkv"

for step in $STEPS; do
  case $step in
    tests)
      python -m pytest -q tests_gpu 2>&1 | tee "$OUT/tests_gpu_$COMMIT.txt"
      ;;
    decode)
      for batch in 1 4 8; do
        # Batch 1 also records a torch.profiler trace of 5 steps (kernels, GPU vs host time) of the
        # stock static cache and a few methods: the profile the closing note compares.
        profiled=""
        [ "$batch" = 1 ] && profiled="stock-static,snapkv,tova,h2o,subgen,bumblebee"
        python benchmarks/bench_gpu.py --context 32768 --batch "$batch" --compile \
          --configs "stock-cudnn-off,stock-static,$PREFILL_ONLY,$EVICTING" ${profiled:+--profile "$profiled"}
      done
      ;;
    prefill)
      for context in 8192 32768; do
        python benchmarks/bench_gpu.py --context "$context" --batch 1 --decode-tokens 4 \
          --configs "stock-cudnn-off,full,snapkv,h2o,buzz,bumblebee,subgen,ahakv"
      done
      ;;
    capacity)
      for method in full snapkv h2o; do
        for chunk in "" 4096; do
          kvhive bench --device cuda --shape llama3-8b --dtype bfloat16 --method "$method" --budget 0.1 \
            --context 32768 --search batch --decode-tokens 32 ${chunk:+--prefill-chunk "$chunk"} --json \
            > "$OUT/capacity_${method}_${chunk:-whole}_$COMMIT.json"
        done
        kvhive bench --device cuda --shape llama3-8b --dtype bfloat16 --method "$method" --budget 0.1 \
          --context 32768 --search batch --decode-tokens 32 --rows-alone --prefill-chunk 4096 --json \
          > "$OUT/capacity_${method}_rows_alone_$COMMIT.json"
      done
      for method in h2o snapkv; do
        kvhive bench --device cuda --shape llama3-8b --dtype bfloat16 --method "$method" --budget 0.1 \
          --context 32768 --batch-size 48 --decode-tokens 32 --rows-alone --prefill-chunk 4096 --compile \
          --no-baseline --json \
          > "$OUT/throughput_${method}_b48_rows_alone_$COMMIT.json"
      done
      ;;
    stream)
      python benchmarks/bench_stream.py --shape llama3-8b --device cuda --dtype bfloat16 --budget 32768 \
        --chunk 5000 --tokens 1000000 --methods h2o,buzz,subgen,streamingllm --out "$OUT/stream_gpu.jsonl"
      ;;
    *)
      echo "scripts/gpu_run.sh: unknown step '$step' (expected: tests decode prefill capacity stream)" >&2
      exit 2
      ;;
  esac
done
