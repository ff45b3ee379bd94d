"""argparse wiring for ``kvhive eval`` and ``kvhive report`` (the main ``kvhive`` CLI calls these).

    parser = argparse.ArgumentParser(prog="kvhive")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_eval_arguments(subparsers, backend_factory=make_backend, method_validator=is_registered)
    add_report_arguments(subparsers)
    args = parser.parse_args()
    args.func(args)

``backend_factory(model_name) -> Backend`` keeps model code out of this package.
Lists are comma-separated: ``--tasks needle,mdqa --methods snapkv,h2o --budgets 0.1,0.5,128``;
a task may carry parameters: ``--tasks needle:lengths=256+512:depths=0+50,xsum``, and a method
options: ``--methods buzz:budget_form=peak,h2o``, or the cache option ``prefill_chunk``
(``--methods snapkv,snapkv:prefill_chunk=512``: the same method with a chunked prefill, a setting of
its own).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvhive.models.embedded import DEFAULT_MODEL

from .backend import DEFAULT_DTYPE, DTYPES, FULL_METHOD, Backend, parse_budgets
from .report import write_report
from .results import ResultsLineSkipped, read_results
from .runner import run_eval, validate_out_dir
from .suites import SUITES, get_suite

BackendFactory = Callable[[str], Backend]


def default_data_dir() -> Path:
    """``$KVHIVE_DATA_DIR``, else ``<repo>/../shared/data``."""
    env = os.environ.get("KVHIVE_DATA_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    return (repo.parent / "shared" / "data").resolve()


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _budget_list(text: str) -> list[float | int]:
    try:
        return parse_budgets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _kv_bits_list(text: str) -> list[int]:
    widths = _comma_list(text)
    if not widths or any(width not in ("4", "8") for width in widths):
        raise argparse.ArgumentTypeError(f"invalid --kv-bits {text!r}: expected comma-separated values among 4, 8")
    return [int(width) for width in widths]


def with_kv_bits(methods, widths: list[int] | None):
    """Each method spec, then the same spec stored in each of ``widths`` bits (``METHOD:kv_bits=N``); the
    full cache once, unquantized. ``methods`` is a list, or a dict of lists per task (a suite's)."""
    if not widths:
        return methods
    if isinstance(methods, dict):
        return {task: with_kv_bits(listed, widths) for task, listed in methods.items()}
    return [
        spec
        for method in methods
        for spec in (method, *(f"{method}:kv_bits={bits}" for bits in widths if method != FULL_METHOD))
    ]


def add_eval_arguments(
    subparsers: Any,
    backend_factory: BackendFactory | None = None,
    method_validator: Callable[[str], Any] | None = None,
) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command; ``args.func(args)`` runs it."""
    parser = subparsers.add_parser(
        "eval",
        help="run the evaluation grid (resumable) and write a report",
        description="Run task x item x (method, budget); results go to OUT/results.jsonl (a rerun resumes).",
    )
    parser.add_argument("--tasks", type=_comma_list, help="comma-separated task names/specs (default: the suite's)")
    parser.add_argument(
        "--methods",
        type=_comma_list,
        help="comma-separated method registry names, each optionally with options like a task's: "
        "buzz:budget_form=peak,ahakv:gain_input=scaled_qk; the cache option prefill_chunk=N feeds the prompt in "
        "chunks of N tokens (snapkv:prefill_chunk=512, its own setting next to the one-shot snapkv)",
    )
    parser.add_argument(
        "--budgets",
        type=_budget_list,
        help="comma-separated budgets: a decimal in (0, 1] is a ratio, an integer is tokens per head (e.g. 0.1,0.5,128); "
        "default: each task's own",
    )
    parser.add_argument(
        "--kv-bits",
        type=_kv_bits_list,
        default=None,
        help="comma-separated bit widths (4, 8): every method also runs with its kept keys and values stored "
        "in each (METHOD:kv_bits=N, a setting of its own); the report plots quality against the bytes held",
    )
    parser.add_argument("--limit", type=int, help="max items per task (default: the suite's, else all)")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name for the backend, e.g. qwen2.5-0.5b (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="shared data folder (default $KVHIVE_DATA_DIR or <repo>/../shared/data)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/eval-<model>-<suite>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help=f"load the model in this dtype (default: the suite's, else {DEFAULT_DTYPE}); recorded with every result",
    )
    parser.add_argument("--suite", choices=sorted(SUITES), help="a predefined grid; explicit options override it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs: cpu, cuda, cuda:N (default: a GPU when torch sees one, else the CPU)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.md after the run")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="spread the items over Ray workers (needs kvhive[ray]); alone: a local Ray instance, "
        "ADDRESS (auto, HOST:PORT, ray://HOST:PORT): join that cluster",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --ray: workers, each holding one model (default: one per GPU, else one per CPU)",
    )
    parser.set_defaults(func=run_eval_command, backend_factory=backend_factory, method_validator=method_validator)
    return parser


def add_report_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` sub-command (``report.md`` + PNGs from OUT/results.jsonl)."""
    parser = subparsers.add_parser("report", help="write report.md and plots from an eval output folder")
    parser.add_argument("out_dir", nargs="?", type=Path, help="the eval output folder")
    parser.add_argument("--out", type=Path, dest="out_option", help="the eval output folder (same as the positional)")
    parser.add_argument(
        "--margin", type=float, default=0.05, help="flag tasks whose full-cache score is within this of chance"
    )
    parser.add_argument(
        "--claims", choices=("auto", "yes", "no"), default="auto", help="include the paper-claims section"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        metavar="OTHER_OUT",
        help="another eval output folder (repeatable): the paper claims side by side, this run first",
    )
    parser.set_defaults(func=run_report_command)
    return parser


def resolve_eval_grid(args: argparse.Namespace) -> dict[str, Any]:
    """Tasks, methods, budgets, limit and out dir from the options and the suite."""
    suite = get_suite(args.suite) if args.suite else None
    tasks = args.tasks or (list(suite.tasks) if suite else None)
    if not tasks:
        raise SystemExit("kvhive eval: give --tasks or --suite")
    methods = args.methods or (suite.methods if suite else None)
    if not methods:
        raise SystemExit("kvhive eval: give --methods or --suite")
    methods = with_kv_bits(methods, getattr(args, "kv_bits", None))
    budgets = args.budgets if args.budgets is not None else (suite.budgets if suite else None)
    limit = args.limit if args.limit is not None else (suite.limit if suite else None)
    if suite is not None and args.tasks:
        # restricting a suite to some tasks keeps the suite's per-task methods/budgets for them
        names = [t.split(":")[0] for t in tasks]
        if isinstance(methods, dict):
            methods = {k: v for k, v in methods.items() if k in names}
        if isinstance(budgets, dict):
            budgets = {k: v for k, v in budgets.items() if k in names}
    out = args.out or Path("runs") / f"eval-{args.model}-{args.suite or 'custom'}"
    dtype = getattr(args, "dtype", None) or (suite.dtype if suite else None) or DEFAULT_DTYPE
    return {"tasks": tasks, "methods": methods, "budgets": budgets, "limit": limit, "out_dir": out, "dtype": dtype}


@contextlib.contextmanager
def lines_said(command: str) -> Iterator[None]:
    """Say on stderr, one line each, the lines of results.jsonl that the block skipped or dropped
    (:class:`ResultsLineSkipped` warnings, each once), naming the file and line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResultsLineSkipped)
        try:
            yield
        finally:
            said = set()
            for warning in caught:
                message = str(warning.message)
                if not issubclass(warning.category, ResultsLineSkipped):
                    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
                elif message not in said:
                    said.add(message)
                    print(f"kvhive {command}: {message}", file=sys.stderr)


def _say_expected_duration(args: argparse.Namespace) -> None:
    """One line on stderr, for a named suite, of how long it takes (what its committed runs took)."""
    if not getattr(args, "suite", None):
        return
    suite = get_suite(args.suite)
    if suite.expected_duration:
        print(f"kvhive eval: suite {suite.name!r} takes {suite.expected_duration}", file=sys.stderr)


def run_eval_command(args: argparse.Namespace) -> int:
    factory = getattr(args, "backend_factory", None)
    if factory is None:
        raise SystemExit("kvhive eval: no backend factory was wired into the CLI")
    grid = resolve_eval_grid(args)
    validate_out_dir(grid["out_dir"])  # before the model loads and anything is computed
    dtype = grid["dtype"]
    if dtype != DEFAULT_DTYPE:
        factory = functools.partial(factory, dtype=dtype)
    if getattr(args, "device", None) is not None:
        factory = functools.partial(factory, device=args.device)
    _say_expected_duration(args)
    data_dir = args.data_dir or default_data_dir()
    grid_arguments = (grid["tasks"], grid["methods"], grid["budgets"], grid["limit"], data_dir, grid["out_dir"])
    options = dict(
        seed=args.seed,
        progress=not args.no_progress,
        method_validator=getattr(args, "method_validator", None),
        suite=args.suite,
        dtype=dtype,
    )
    try:
        with lines_said("eval"):
            if getattr(args, "ray", None) is not None or getattr(args, "workers", None) is not None:
                run = _run_eval_on_ray(args, factory, grid_arguments, options)
            else:
                run = run_eval(factory(args.model), *grid_arguments, model_name=args.model, **options)
    except KeyboardInterrupt:
        # Every finished result is already durable (one fsync per line); say so and how to go on.
        try:
            saved = (
                f"{len(read_results(grid['out_dir']))} results are saved in {Path(grid['out_dir']) / 'results.jsonl'}"
            )
        except (OSError, ValueError):
            saved = f"finished results are saved in {Path(grid['out_dir']) / 'results.jsonl'}"
        command = shlex.join(["kvhive", *(getattr(args, "argv", None) or sys.argv[1:])])
        print(f"kvhive eval: interrupted; {saved}; resume with: {command}", file=sys.stderr)
        return 130
    print(f"{run.written} new results ({run.skipped} already done, {run.total} in the grid) -> {run.results_path}")
    if run.transient:
        print(
            f"{run.transient} results could not be computed this time (a worker died or ran out of memory; "
            "see their reason in the report): rerun the same command to retry them"
        )
    if not args.no_report:
        with lines_said("report"):
            write_report(grid["out_dir"])
        print(f"report: {Path(grid['out_dir']) / 'report.md'}")
    return 0


def _run_eval_on_ray(args: argparse.Namespace, factory: BackendFactory, grid_arguments: tuple, options: dict):
    """``kvhive eval --ray``: the same grid, items spread over Ray workers (kvhive.evaluation.distributed)."""
    if args.ray is None:
        raise SystemExit("kvhive eval: --workers needs --ray (workers are Ray actors)")
    if args.workers is not None and args.workers < 1:
        raise SystemExit(f"kvhive eval: --workers must be an integer >= 1, got {args.workers}")
    try:
        from .distributed import RayClusterError, require_ray, run_eval_distributed

        require_ray()
    except ImportError as error:
        raise SystemExit(f"kvhive eval: --ray: {error}") from None
    address = None if args.ray == "local" else args.ray
    try:
        return run_eval_distributed(
            factory, args.model, *grid_arguments, address=address, workers=args.workers, **options
        )
    except RayClusterError as error:  # one line: the cluster is gone or was never there
        raise SystemExit(f"kvhive eval: --ray: {error}") from None


def run_report_command(args: argparse.Namespace) -> int:
    out = args.out_dir or args.out_option
    if out is None:
        raise SystemExit("kvhive report: give the eval output folder")
    if not (Path(out) / "results.jsonl").exists():
        raise SystemExit(f"kvhive report: no results.jsonl in {out}")
    include = {"auto": None, "yes": True, "no": False}[args.claims]
    for other in args.compare:
        if not (Path(other) / "results.jsonl").exists():
            raise SystemExit(f"kvhive report: --compare {other}: no results.jsonl there")
    with lines_said("report"):
        write_report(out, margin=args.margin, include_claims=include, compare=args.compare)
    print(f"report: {Path(out) / 'report.md'}")
    return 0


def main(argv: Sequence[str] | None = None, backend_factory: BackendFactory | None = None) -> int:
    """Stand-alone entry (``python -m kvhive.evaluation.cli report OUT``); ``eval`` needs a factory."""
    parser = argparse.ArgumentParser(prog="kvhive")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_eval_arguments(subparsers, backend_factory=backend_factory)
    add_report_arguments(subparsers)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
