"""BUZZ speed on CPU: what compression adds to a prefill, and what it costs per streamed token.

1. ``prefill+compress / prefill`` at 2k/4k/8k tokens on ``kvhive.models.kv_heavy_model()``:
   the time of a prefill with a BUZZ cache (accumulated attention over every prompt query,
   Remark 2's sampling, eviction) divided by the time of the same prefill with an uncompressed
   kvhive cache (method ``full``); plain transformers (sdpa + DynamicCache) is printed too.
2. Per-token streaming cost: after a prompt, decode ``--decode-tokens`` tokens one at a time and
   report ms/token for plain transformers, the uncompressed kvhive cache and BUZZ (which also
   accumulates each step's attention and evicts every time the threshold is reached).

    python benchmarks/bench_buzz.py                       # 2k/4k/8k, budget 256
    python benchmarks/bench_buzz.py --lengths 1024 2048 --decode-tokens 32 --threads 2

Prefill times are medians of ``--repeats`` runs (halved above 4k tokens) after one short
warm-up prefill per cache kind. Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvhive.api import make_cache
from kvhive.compat import cache_kwarg
from kvhive.methods.buzz import EVICTIONS
from kvhive.models import kv_heavy_model


def _median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plain_cache(model):
    model.set_attn_implementation("sdpa")
    return DynamicCache(config=model.config)


@torch.no_grad()
def prefill_seconds(model, input_ids, method: str | None, budget: int | None, repeats: int, **parameters) -> float:
    def run():
        cache = _plain_cache(model) if method is None else make_cache(model, method, budget, **parameters)
        model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)

    return _median_seconds(run, repeats)


@torch.no_grad()
def start_stream(model, input_ids, method: str | None, budget: int | None, **parameters):
    """A cache holding the prompt plus one decoded token (so lazy initialisation is not timed)."""
    cache = _plain_cache(model) if method is None else make_cache(model, method, budget, **parameters)
    output = model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    token = output.logits[:, -1].argmax(-1, keepdim=True)
    output = model(input_ids=token, **{cache_kwarg(model): cache}, use_cache=True)
    return cache, output.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def stream_ms_per_token(model, cache, token, method: str | None, tokens: int):
    """ms/token over ``tokens`` greedy steps; returns (ms, next token)."""
    if method is None:
        model.set_attn_implementation("sdpa")
    else:
        model.set_attn_implementation("kvhive")
    start = time.perf_counter()
    for _ in range(tokens):
        output = model(input_ids=token, **{cache_kwarg(model): cache}, use_cache=True)
        token = output.logits[:, -1].argmax(-1, keepdim=True)
    return 1000 * (time.perf_counter() - start) / tokens, token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=int, default=256, help="BUZZ budget C = k + w + T (tokens per head)")
    parser.add_argument("--stride", type=int, default=5)
    parser.add_argument("--decode-prompt", type=int, default=2048, help="prompt length before streaming")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--skip-prefill", action="store_true", help="only the streaming part")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)

    model = kv_heavy_model(num_layers=arguments.layers)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    buzz = {"stride": arguments.stride}
    layout = make_cache(model, "buzz", arguments.budget, **buzz).policy.layout(arguments.budget)
    print(
        f"kv_heavy_model: {arguments.layers} layers, 16 query / 8 KV heads of dim 128; torch threads "
        f"{torch.get_num_threads()}; BUZZ budget {arguments.budget} = sink {layout.sink} + window "
        f"{layout.window} + threshold {layout.threshold} (stride {arguments.stride})"
    )

    lengths = [] if arguments.skip_prefill else arguments.lengths
    warm_up = torch.randint(3, vocab, (1, 2 * arguments.budget), generator=generator)
    for method in (None, "full", "buzz"):  # lazy initialisation, allocator, kernels
        prefill_seconds(
            model,
            warm_up,
            method,
            arguments.budget if method == "buzz" else None,
            1,
            **(buzz if method == "buzz" else {}),
        )

    if lengths:
        print("\n1. prefill + compress / prefill")
        print(
            f"{'tokens':>7} {'plain sdpa s':>13} {'kvhive full s':>14} {'buzz s':>9} {'buzz/full':>10} {'buzz/plain':>11}"
        )
    for length in lengths:
        input_ids = torch.randint(3, vocab, (1, length), generator=generator)
        repeats = arguments.repeats if length <= 4096 else max(1, arguments.repeats // 2)
        times = {"plain": [], "full": [], "buzz": []}
        for _ in range(repeats):  # interleaved, so a change of machine load hits every cache alike
            times["plain"].append(prefill_seconds(model, input_ids, None, None, 1))
            times["full"].append(prefill_seconds(model, input_ids, "full", None, 1))
            times["buzz"].append(prefill_seconds(model, input_ids, "buzz", arguments.budget, 1, **buzz))
        plain, full, compressed = (statistics.median(times[key]) for key in ("plain", "full", "buzz"))
        print(
            f"{length:>7} {plain:>13.3f} {full:>14.3f} {compressed:>9.3f} {compressed / full:>10.2f} "
            f"{compressed / plain:>11.2f}",
            flush=True,
        )

    print(
        f"\n2. streaming: {arguments.decode_tokens} tokens after a {arguments.decode_prompt}-token prompt "
        f"(median of {arguments.repeats} interleaved rounds)"
    )
    input_ids = torch.randint(3, vocab, (1, arguments.decode_prompt), generator=generator)
    no_eviction = arguments.decode_prompt + (arguments.repeats + 1) * arguments.decode_tokens + 8
    runs = [
        ("plain sdpa (full)", None, None, {}),
        ("kvhive full", "full", None, {}),
        (f"buzz C={arguments.budget}", "buzz", arguments.budget, buzz),
        (f"buzz C={4 * arguments.budget}", "buzz", 4 * arguments.budget, buzz),
        ("buzz, never evicting", "buzz", no_eviction, buzz),
    ]
    streams = {
        label: start_stream(model, input_ids, method, budget, **parameters)
        for label, method, budget, parameters in runs
    }
    times = {label: [] for label, *_ in runs}
    for _ in range(arguments.repeats):
        for label, method, _, _ in runs:
            cache, token = streams[label]
            ms, token = stream_ms_per_token(model, cache, token, method, arguments.decode_tokens)
            streams[label] = (cache, token)
            times[label].append(ms)
    print(f"{'cache':>22} {'ms/token':>9} {'evictions':>10} {'stored':>7}")
    results = {}
    for label, method, _, _ in runs:
        cache = streams[label][0]
        evictions = 0 if method is None else cache.layers[0].policy_state.get(EVICTIONS, 0)
        stored = cache.get_seq_length() if method is None else int(cache.layers[0].lengths.max())
        results[label] = statistics.median(times[label])
        print(f"{label:>22} {results[label]:>9.2f} {evictions:>10} {stored:>7}", flush=True)
    reference = results["kvhive full"]
    for label, ms in results.items():
        if label.startswith("buzz"):
            print(f"{label}: {ms - reference:+.2f} ms/token vs kvhive full ({ms / reference:.2f}x)")


if __name__ == "__main__":
    main()
