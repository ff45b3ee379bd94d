#!/usr/bin/env bash
# Issue 26: BUZZ's Remark 2 prefill thinning in the mean form, prefill_fit="budget" (kvhive's
# default: thin until the layer fits C) vs "peak" (the paper's literal container T + k + w).
# WikiText-2 windows: a prompt of P tokens (BOS included) prefilled in one forward, then 128 tokens
# teacher-forced one at a time. Gemma-3-270M, fp32, CPU, one thread. Resumable: rerun to go on;
# the limit grows in steps of 10 windows, C = 100 and C = 50 in turn, so both stay paired.
#   C = 100: P = 512 (single pass keeps ceil(482/5) = 97 samples, between C - k - w = 70 and T = 113)
#   C =  50: P = 256 (single pass keeps ceil(240/5) = 48, between 34 and T = 54)
# Budgets beside C: today's reading at C' (its mean held memory = the literal reading's at C) and
# the literal reading at C'' (its mean = today's at C); see summary.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
for limit in ${LIMITS:-10 20 30 40 50 60 70 80 90 100}; do
  .venv/bin/kvhive eval --model gemma-3-270m --tasks ppl:num_tokens=63900:window=639:prefill_tokens=512 \
    --methods buzz,buzz:prefill_fit=peak --budgets 95,100,108 --limit "$limit" \
    --out results/buzz_remark2/c100 --no-progress
  .venv/bin/kvhive eval --model gemma-3-270m --tasks ppl:num_tokens=38300:window=383:prefill_tokens=256 \
    --methods buzz,buzz:prefill_fit=peak --budgets 49,50,51 --limit "$limit" \
    --out results/buzz_remark2/c50 --no-progress
done
