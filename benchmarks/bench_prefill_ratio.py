"""prefill+compression / prefill on the kv-heavy 2-layer shape, as `kvhive bench` measures it (full
kvhive cache vs the method's cache, alternating, logits_to_keep=1), medians of R runs of wall time
(perf_counter) and of this process's CPU time (process_time: with OMP_NUM_THREADS=1 it does not
count the time other processes sharing the cores take), next to what issue 25 item 4 asks for
beside them: the host reads of one prefill (``kvhive.diagnostics.HostReadCounter``, counted in an
extra untimed prefill of each cache: the method's minus the full cache's are its compression's)
and the peak memory of each prefill above what was held before it (``kvhive.memory.PhaseMemory``,
the process's resident high-water mark reset per prefill; medians). Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_ratio.py h2o 3 [CONTEXT, default 4096]

results/prefill_column_sums.md: before/after issue 25 item 1; results/prefill_ratios_8k.jsonl."""

import json
import statistics
import sys
import time

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.diagnostics import HostReadCounter
from kvhive.memory import PhaseMemory
from kvhive.models.shapes import kv_heavy_model

method, repeats = sys.argv[1], int(sys.argv[2])
context = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
model = kv_heavy_model(2)
ids = torch.randint(3, 1024, (1, context), generator=torch.Generator().manual_seed(0))
key = cache_kwarg(model)
memory = PhaseMemory("cpu")


def prefill(m, counter=None):
    cache = kvhive.make_cache(model, m, budget=0.1) if m != "full" else kvhive.make_cache(model, "full")
    held = memory.start()
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if counter is None:
            model(input_ids=ids, **{key: cache}, use_cache=True, logits_to_keep=1)
        else:
            with counter:
                model(input_ids=ids, **{key: cache}, use_cache=True, logits_to_keep=1)
    times = time.perf_counter() - wall, time.process_time() - cpu
    peak = memory.peak()
    return (*times, None if peak is None or held is None else peak - held)


prefill("full")  # warm-up
full, meth = [], []
for _ in range(repeats):
    full.append(prefill("full"))
    meth.append(prefill(method))
reads = {}
for name in ("full", method):
    counter = HostReadCounter()
    prefill(name, counter)
    reads[name] = counter.total


def med(xs, i):
    values = [x[i] for x in xs if x[i] is not None]
    return statistics.median(values) if values else None


print(
    json.dumps(
        {
            "method": method,
            "context": context,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "wall_ratio": med(meth, 0) / med(full, 0),
            "cpu_ratio": med(meth, 1) / med(full, 1),
            "prefill_wall": med(full, 0),
            "prefill_cpu": med(full, 1),
            "method_wall": med(meth, 0),
            "method_cpu": med(meth, 1),
            "prefill_peak_bytes_full": med(full, 2),
            "prefill_peak_bytes": med(meth, 2),
            "host_reads_full": reads["full"],
            "host_reads": reads[method],
            "host_reads_of_compression": reads[method] - reads["full"],
        }
    )
)
