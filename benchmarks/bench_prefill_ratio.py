"""prefill+compression / prefill on the kv-heavy 2-layer shape at 4k, as `kvhive bench` measures it
(full kvhive cache vs the method's cache, alternating, logits_to_keep=1), medians of R runs of
wall time (perf_counter) and of this process's CPU time (process_time: with OMP_NUM_THREADS=1 it
does not count the time other processes sharing the cores take). Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_ratio.py h2o 3

results/prefill_column_sums.md: before/after issue 25 item 1."""

import json
import statistics
import sys
import time

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.models.shapes import kv_heavy_model

method, repeats = sys.argv[1], int(sys.argv[2])
model = kv_heavy_model(2)
ids = torch.randint(3, 1024, (1, 4096), generator=torch.Generator().manual_seed(0))
key = cache_kwarg(model)


def prefill(m):
    cache = kvhive.make_cache(model, m, budget=0.1) if m != "full" else kvhive.make_cache(model, "full")
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model(input_ids=ids, **{key: cache}, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - wall, time.process_time() - cpu


prefill("full")  # warm-up
full, meth = [], []
for _ in range(repeats):
    full.append(prefill("full"))
    meth.append(prefill(method))


def med(xs, i):
    return statistics.median(x[i] for x in xs)


print(
    json.dumps(
        {
            "method": method,
            "wall_ratio": med(meth, 0) / med(full, 0),
            "cpu_ratio": med(meth, 1) / med(full, 1),
            "prefill_wall": med(full, 0),
            "prefill_cpu": med(full, 1),
            "method_wall": med(meth, 0),
            "method_cpu": med(meth, 1),
        }
    )
)
