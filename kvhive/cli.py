"""``kvhive`` command line: methods, generate, bench, eval, report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DEFAULT_BUDGET = "0.1"


def _method_parameters(pairs: list[str] | None) -> dict:
    """``--param window=16 --param pooling=avg`` → ``{"window": 16, "pooling": "avg"}``."""
    parameters = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"kvhive: invalid --param {pair!r}: expected NAME=VALUE")
        name, text = pair.split("=", 1)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        parameters[name.strip()] = value
    return parameters


def _method_and_parameters(method: str, pairs: list[str] | None) -> tuple[str, dict]:
    """``--method snapkv:window=4`` (the syntax of ``kvhive eval --methods``) and ``--param``
    options, merged; an option given both ways is refused rather than one silently winning."""
    from kvhive.methods.registry import parse_method_spec

    name, parameters = parse_method_spec(method)
    for option, value in _method_parameters(pairs).items():
        if option in parameters:
            raise ValueError(f"invalid --param {option}=...: option {option!r} is already given in --method {method}")
        parameters[option] = value
    return name, parameters


def _budget_argument(text: str):
    from kvhive.cache import Budget

    try:
        Budget.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _read_prompt_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise SystemExit(f"kvhive generate: cannot read --prompt-file {path!r}: {reason}") from None


def _checked_budget(command: str, method: str, budget: str | None, parameters: dict, default: str | None):
    """The budget to use: refused when an evicting method has none (and no ``default``); None with
    a note when the method keeps everything (the budget the user typed would be ignored)."""
    from kvhive.methods import make_policy

    policy = make_policy(method, **parameters)
    if not policy.phases:
        if budget is not None:
            print(
                f"kvhive {command}: note: --method {method} keeps every token; --budget {budget} is ignored",
                file=sys.stderr,
            )
        return None
    if budget is None:
        if default is None:
            raise SystemExit(
                f"kvhive {command}: --method {method} needs --budget (tokens per head, e.g. 64, or a ratio of the "
                "prompt, e.g. 0.2); no budget was given and there is no default (only --method full needs none)"
            )
        return default
    return budget


def command_methods(args: argparse.Namespace) -> int:
    from kvhive.methods.registry import method_names, policy_class

    rows = [policy_class(name).describe() for name in method_names()]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        phases = ", ".join(row["phases"]) or "none (no eviction)"
        parameters = ", ".join(f"{k}={v!r}" for k, v in row["parameters"].items()) or "-"
        print(f"{row['name']:<18} phases: {phases:<17} parameters: {parameters}")
        if row["paper"]:
            print(f"{'':<18} {row['paper']}")
    return 0


def _positive_int_argument(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {value}")
        return value

    return parse


def command_generate(args: argparse.Namespace) -> int:
    import kvhive

    given = sum(source is not None for source in (args.prompt, args.prompt_file, args.prompts_file))
    if given != 1:
        raise SystemExit("kvhive generate: give a PROMPT, --prompt-file or --prompts-file (exactly one)")
    if args.prompts_file is not None and args.prefill_question is not None:
        raise SystemExit("kvhive generate: --prefill-question is one prompt's question; not with --prompts-file")
    if args.prompts_file is not None:
        return _generate_batch(args)
    if args.max_batch_size is not None:
        raise SystemExit("kvhive generate: --max-batch-size applies to --prompts-file (a batch of prompts)")
    if args.sample or any(value is not None for value in (args.temperature, args.top_k, args.top_p, args.seed)):
        raise SystemExit(
            "kvhive generate: --sample, --temperature, --top-k, --top-p and --seed apply to --prompts-file "
            "(a single prompt decodes greedily)"
        )
    if args.prefill_question is not None and args.prefill_chunk is None:
        raise SystemExit("kvhive generate: --prefill-question applies to a chunked prefill; give --prefill-chunk N too")
    if args.per_layer and not args.json:
        raise SystemExit("kvhive generate: --per-layer adds detail to --json output; give --json too")
    method, parameters = _method_and_parameters(args.method, args.param)
    budget = _checked_budget("generate", method, args.budget, parameters, default=None)
    parameters.update(_kv_bits_option(args))
    prompt = args.prompt if args.prompt is not None else _read_prompt_file(args.prompt_file)
    from kvhive.progress import GenerationProgress

    model, tokenizer = kvhive.load_model(args.model, device=args.device)
    text, cache = kvhive.generate(
        model,
        tokenizer,
        prompt,
        method,
        budget,
        max_new_tokens=args.max_new_tokens,
        compress_sliding=args.compress_sliding,
        compile=args.compile,
        prefill_chunk=args.prefill_chunk,
        question=args.prefill_question,
        streamer=GenerationProgress(args.max_new_tokens, enabled=not args.no_progress),
        **parameters,
    )
    statistics = cache.statistics()
    if args.json:
        print(
            json.dumps({"text": text, **generation_statistics(cache, statistics, per_layer=args.per_layer)}, indent=2)
        )
    else:
        print(text)
        print(savings_headline(cache, statistics), file=sys.stderr)
    return 0


def _read_prompts_file(path: str) -> list[str]:
    """One prompt per line (empty lines skipped; ``\\n`` in a line is a newline of its prompt)."""
    text = _read_prompt_file(path)
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"kvhive generate: --prompts-file {path!r} holds no prompt (one prompt per line)")
    return prompts


def _generate_batch(args: argparse.Namespace) -> int:
    """``--prompts-file``: every prompt prefilled alone, all decoded together (``kvhive.generate_batch``);
    prints one line per prompt, its text as a JSON string (``--json``: an object with the texts)."""
    import kvhive

    if args.per_layer:
        raise SystemExit("kvhive generate: --prompts-file prints texts: no --per-layer")
    try:
        prompts = _read_prompts_file(args.prompts_file)
    except SystemExit as error:
        raise SystemExit(str(error).replace("--prompt-file", "--prompts-file")) from None
    if args.kv_bits is not None:
        raise SystemExit("kvhive generate: --kv-bits is not supported with --prompts-file (a batch of prompts)")
    method, parameters = _method_and_parameters(args.method, args.param)
    budget = _checked_budget("generate", method, args.budget, parameters, default=None)
    model, tokenizer = kvhive.load_model(args.model, device=args.device)
    texts = kvhive.generate_batch(
        model,
        tokenizer,
        prompts,
        method,
        budget,
        max_new_tokens=args.max_new_tokens,
        compress_sliding=args.compress_sliding,
        prefill_chunk=args.prefill_chunk,
        max_batch_size=args.max_batch_size,
        compile=bool(args.compile),  # --compile: one graph for every step of the fixed batch slots
        do_sample=args.sample,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        **parameters,
    )
    if args.json:
        print(json.dumps({"method": method, "budget": budget, "texts": texts}, indent=2))
    else:
        for text in texts:
            print(json.dumps(text))
    return 0


def _compression_scope(cache) -> dict:
    """Which layers the budget applies to: sliding-window layers are left at their window unless
    ``compress_sliding`` (on Gemma-3-270M that is 15 of 18 layers)."""
    sliding_left = [layer for i, layer in enumerate(cache.layers) if layer.is_sliding and not cache.is_compressed(i)]
    return {
        "layers": len(cache.layers),
        "compressed_layers": len(cache.compressed_layers),
        "sliding_layers_at_window": len(sliding_left),
        "sliding_window": max((layer.sliding_window for layer in sliding_left), default=None),
    }


def generation_statistics(cache, statistics: dict, per_layer: bool = False) -> dict:
    """``cache.statistics()`` for ``generate --json``: the bytes a budget saves as a headline
    (``cache_fraction_of_full`` = cache bytes / full-cache bytes), per-layer lists only with
    ``per_layer`` (they run to one line per head per layer)."""
    full_bytes = statistics["full_cache_bytes"]
    out = {
        "method": statistics["method"],
        "budget": statistics["budget"],
        "cache_fraction_of_full": round(statistics["cache_bytes"] / full_bytes, 4) if full_bytes else None,
        **_compression_scope(cache),
        "tokens_seen": statistics["tokens_seen"],
        "kept_tokens_total": statistics["kept_tokens_total"],
        "mean_kept_per_head": round(cache.mean_kept_per_head(), 1),
    }
    out.update(
        {k: v for k, v in statistics.items() if k not in out and k not in ("kept_tokens_per_layer", "layer_budgets")}
    )
    budgets = sorted(set(statistics["layer_budgets"].values()))
    out["layer_budget_range"] = [budgets[0], budgets[-1]] if budgets else None
    if per_layer:
        out["layer_budgets"] = statistics["layer_budgets"]
        out["kept_tokens_per_layer"] = statistics["kept_tokens_per_layer"]
    return out


def savings_headline(cache, statistics: dict) -> str:
    """One line: the fraction of the full cache's bytes the cache holds, and which layers the
    budget touched (a nominal ratio says little when most layers are sliding-window layers)."""
    full_bytes = statistics["full_cache_bytes"]
    if not full_bytes:
        return "kvhive: the cache holds no tokens"
    fraction = statistics["cache_bytes"] / full_bytes
    scope = _compression_scope(cache)
    line = (
        f"kvhive: {statistics['method']} at budget {statistics['budget']} holds {fraction:.3f} of the full cache's "
        f"bytes (saves {1 - fraction:.1%}); budget applied to {scope['compressed_layers']} of {scope['layers']} layers"
    )
    if scope["sliding_layers_at_window"]:
        line += (
            f"; {scope['sliding_layers_at_window']} sliding-window layers keep their {scope['sliding_window']}-token "
            "window (--compress-sliding compresses them too)"
        )
    return line


def _kv_bits_option(args: argparse.Namespace) -> dict:
    """``--kv-bits`` as ``make_cache``'s keyword (empty when not given: the model's dtype)."""
    return {} if args.kv_bits is None else {"kv_bits": args.kv_bits}


def _add_kv_bits_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="store the kept keys and values as int8 (8) or packed int4 (4) codes with scales (default: the "
        "model's dtype)",
    )


def command_bench(args: argparse.Namespace) -> int:
    from kvhive import bench

    given = {"--memory-limit": args.memory_limit, "--search-step": args.search_step, "--search-max": args.search_max}
    for flag, value in given.items():
        if value is not None and args.search is None:
            raise SystemExit(f"kvhive bench: {flag} belongs to a --search (context or batch); give --search too")
    if args.kv_bits is not None and (args.search is not None or args.varlen):
        raise SystemExit("kvhive bench: --kv-bits applies to a method's benchmark, not --search or --varlen")
    if args.search is not None:
        return _command_bench_search(args)
    if args.varlen:
        result = bench.variable_length_attention_benchmark(
            context=args.context, device=args.device, batch_size=args.batch_size, dtype=bench.DTYPES[args.dtype]
        )
    else:
        method, parameters = _method_and_parameters(args.method, args.param)
        budget = _checked_budget("bench", method, args.budget, parameters, default=BENCH_DEFAULT_BUDGET)
        parameters.update(_kv_bits_option(args))
        result = bench.run_benchmark(
            shape=args.shape,
            method=method,
            budget=budget,
            context=args.context,
            decode_tokens=args.decode_tokens,
            batch_size=args.batch_size,
            repeats=args.repeats,
            num_layers=args.num_layers,
            device=args.device,
            method_parameters=parameters,
            dtype=bench.DTYPES[args.dtype],
            compile=args.compile,
            prefill_chunk=args.prefill_chunk,
            rows_alone=args.rows_alone,
            baseline=args.baseline,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<30} {value:.4g}" if isinstance(value, float) else f"{key:<30} {value}")
        if not args.varlen:
            print("\n".join(bench.memory_lines(result)))
    return 0


def _memory_limit_argument(text: str) -> int:
    from kvhive.memory import parse_memory_size

    try:
        return parse_memory_size(text, "--memory-limit")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _capacity_search(args: argparse.Namespace, budget, parameters: dict, report) -> dict:
    from kvhive.capacity import capacity_search

    return capacity_search(
        args.search,
        memory_limit=args.memory_limit,
        shape=args.shape,
        method=args.method,
        budget=budget,
        context=args.context,
        batch_size=args.batch_size,
        decode_tokens=args.decode_tokens,
        num_layers=args.num_layers,
        device=args.device,
        dtype=args.dtype,
        method_parameters=parameters,
        step=args.search_step,
        maximum=args.search_max,
        report=report,
        prefill_chunk=args.prefill_chunk,
        rows_alone=args.rows_alone,
    )


def _command_bench_search(args: argparse.Namespace) -> int:
    """``kvhive bench --search context|batch``: each trial's outcome on stderr as it comes, the
    boundary on stdout (or everything as JSON)."""
    from kvhive.memory import format_bytes

    if args.varlen:
        raise SystemExit("kvhive bench: --search and --varlen are different benchmarks; give one")
    parameters = _method_parameters(args.param)
    budget = _checked_budget("bench", args.method, args.budget, parameters, default=BENCH_DEFAULT_BUDGET)
    fixed = f"batch {args.batch_size}" if args.search == "context" else f"context {args.context}"

    from kvhive.progress import trial_progress

    bar = trial_progress(args.search, enabled=not args.no_progress)

    def report(outcome) -> None:
        verdict = "fits" if outcome.fits else "does not fit"
        bar.update(1)
        bar.write(
            f"kvhive bench: {args.search} {outcome.value} ({fixed}): {verdict}: {outcome.reason}", file=sys.stderr
        )

    try:
        result = _capacity_search(args, budget, parameters, report)
    except RuntimeError as error:  # a trial that failed for a reason other than memory
        print(f"kvhive bench: error: {error}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    what = "longest prompt" if args.search == "context" else "largest batch"
    run = (
        f"{args.method}{'' if budget is None else f' at budget {budget}'}, {fixed}, {args.decode_tokens} decode tokens"
    )
    limit = format_bytes(result["memory_limit_bytes"])
    if result["largest_fitting"] is None:
        print(f"{what} within {limit} ({run}): none; even {result['smallest_failing']} does not fit")
    else:
        beyond = result["smallest_failing"]
        tail = f"; {beyond} does not" if beyond is not None else f" (the search maximum, {result['maximum']})"
        print(f"{what} within {limit} ({run}): {result['largest_fitting']}{tail}")
    print(f"measured: {result['measure']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvhive.bench import SHAPES
    from kvhive.evaluation.cli import add_eval_arguments, add_report_arguments
    from kvhive.evaluation.kvhive_backend import make_backend
    from kvhive.methods.registry import canonical_method_spec
    from kvhive.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

    parser = argparse.ArgumentParser(prog="kvhive", description="KV-cache compression for Hugging Face causal LMs")
    subparsers = parser.add_subparsers(dest="command", required=True)

    methods = subparsers.add_parser("methods", help="list the methods with their phases and parameters")
    methods.add_argument("--json", action="store_true")
    methods.set_defaults(func=command_methods)

    generate = subparsers.add_parser("generate", help="greedy generation with a compressed cache")
    generate.add_argument("prompt", nargs="?", help="the prompt text")
    generate.add_argument("--prompt-file", help="read the prompt from this file")
    generate.add_argument(
        "--prompts-file",
        help="several prompts, one per line: each prefilled alone, all decoded together (kvhive.generate_batch); "
        "prints one JSON string per prompt",
    )
    generate.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name or path: {', '.join(EMBEDDED_MODELS)} (embedded; default {DEFAULT_MODEL}, a base model that "
        "continues text; qwen2.5-0.5b is the chat model, for instructions), a tiny-* test model, a local directory "
        "or .gguf file",
    )
    generate.add_argument(
        "--method",
        default="full",
        help="registry name (see `kvhive methods`), optionally with options as in eval: snapkv:window=4",
    )
    generate.add_argument(
        "--budget",
        type=_budget_argument,
        default=None,
        help="tokens per head (integer >= 1) or a ratio of the prompt (float in (0, 1])",
    )
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter (repeatable)")
    generate.add_argument("--compress-sliding", action="store_true", help="also compress sliding-window layers")
    _add_kv_bits_argument(generate)
    generate.add_argument(
        "--prefill-chunk",
        type=_positive_int_argument("--prefill-chunk"),
        default=None,
        metavar="N",
        help="feed the prompt in chunks of N tokens, compressing as it goes (peak memory: budget + one chunk)",
    )
    generate.add_argument(
        "--prefill-question",
        default=None,
        metavar="TEXT",
        help="with --prefill-chunk and a prefill-only method (snapkv, pyramidkv, knorm): the prompt's final part, its "
        "question (the prompt must end with it); every chunk is scored with the question's queries (a copy of the "
        "question fed after the chunk, then dropped) instead of the chunk's own",
    )
    generate.add_argument(
        "--max-batch-size",
        type=_positive_int_argument("--max-batch-size"),
        default=None,
        metavar="N",
        help="with --prompts-file: decode at most N prompts at once; the others wait and each joins the running "
        "batch as soon as a row finishes (default: all prompts at once)",
    )
    generate.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the decode step (torch.compile, one graph; refused for a method whose step cannot) or, "
        "with --no-compile, decode eagerly; default: transformers' choice (compiled on a GPU when possible)",
    )
    generate.add_argument(
        "--sample",
        action="store_true",
        help="with --prompts-file: sample each row's tokens (else greedy), with its own generator",
    )
    generate.add_argument("--temperature", type=float, default=None, help="with --sample: softmax temperature (> 0)")
    generate.add_argument("--top-k", type=int, default=None, help="with --sample: draw among the k likeliest tokens")
    generate.add_argument("--top-p", type=float, default=None, help="with --sample: draw within the top-p nucleus")
    generate.add_argument(
        "--seed", type=int, default=None, help="with --sample: every row's generator seed (default: random)"
    )
    generate.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu (default), cuda, cuda:N, mps (kvhive.load_model(device=...))",
    )
    generate.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only on a terminal)")
    generate.add_argument("--json", action="store_true", help="print the text with cache statistics (a summary)")
    generate.add_argument(
        "--per-layer",
        action="store_true",
        help="with --json: also the per-layer budgets and kept tokens per layer and head",
    )
    generate.set_defaults(func=command_generate)

    bench = subparsers.add_parser("bench", help="prefill/compression/decode time and cache memory for one method")
    bench.add_argument(
        "--shape",
        default="kv-heavy",
        choices=SHAPES,
        help=f"model: random-weight kv-heavy / llama3-8b shapes, or an embedded model ({DEFAULT_MODEL} = embedded)",
    )
    bench.add_argument("--method", default="snapkv")
    bench.add_argument(
        "--budget",
        type=_budget_argument,
        default=None,
        help=f"tokens per head or a ratio of the context (default {BENCH_DEFAULT_BUDGET}; ignored for --method full)",
    )
    bench.add_argument("--context", type=int, default=8192)
    bench.add_argument("--decode-tokens", type=int, default=32)
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--num-layers", type=int, default=None)
    bench.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    bench.add_argument(
        "--no-progress", action="store_true", help="with --search: no progress bar (drawn only on a terminal)"
    )
    bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    bench.add_argument("--param", action="append", metavar="NAME=VALUE")
    bench.add_argument(
        "--varlen",
        action="store_true",
        help="instead: variable-length decode attention vs dense sdpa at equal total length",
    )
    _add_kv_bits_argument(bench)
    bench.add_argument(
        "--search",
        choices=("context", "batch"),
        default=None,
        help="instead: find the longest prompt (context, at --batch-size) or the largest batch (at --context) "
        "that fits --memory-limit, by bisection from --context / --batch-size; each trial in a fresh process",
    )
    bench.add_argument(
        "--memory-limit",
        type=_memory_limit_argument,
        default=None,
        metavar="SIZE",
        help="with --search: the memory to fit in, e.g. 8GB or 512MiB (CPU: required, compared with the trial "
        "process's resident peak; CUDA: default the device's memory, the allocator capped at it)",
    )
    bench.add_argument(
        "--search-step", type=int, default=None, help="with --search: granularity (default: context 256, batch 1)"
    )
    bench.add_argument(
        "--search-max",
        type=int,
        default=None,
        help="with --search: largest value tried (default: context the model's positions, batch 4096)",
    )
    bench.add_argument(
        "--compile",
        action="store_true",
        help="compile both decode steps (torch.compile, one graph; the full cache as transformers' StaticCache); "
        "refused for a method whose step cannot compile",
    )
    bench.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="feed the prompt in chunks of N tokens, each compressed as it comes (the full cache takes the same "
        "chunks); with --search, every trial does",
    )
    bench.add_argument(
        "--rows-alone",
        action="store_true",
        help="prefill each row of the batch alone into fixed batch slots and decode the rows together "
        "(kvhive.generate_batch's serving path): the prefill holds one row's activations, not the batch's; "
        "with --search, every trial does",
    )
    bench.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the full cache on the same prompts (default); --no-baseline: the method alone, for a "
        "batch whose full cache would not fit",
    )
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=command_bench)

    add_eval_arguments(subparsers, backend_factory=make_backend, method_validator=canonical_method_spec)
    add_report_arguments(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `kvhive eval` says how to resume with it
    from kvhive.evaluation.results import ResultsLockedError
    from kvhive.models import MissingModelExtraError

    try:
        return args.func(args)
    except (ValueError, OSError, ResultsLockedError, MissingModelExtraError) as error:
        # Bad input, a concurrent run on the same output folder, a read-only or full disk: one
        # line naming the problem (results already written stay valid), not a traceback.
        print(f"kvhive {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
