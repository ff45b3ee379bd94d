"""Resumable evaluation grid: task x item x (method, budget) -> ``OUT/results.jsonl``.

For each item, every pending (method, budget) setting goes into ONE backend call (so the backend
can prefill once and serve all settings); each result is appended as one JSON line as soon as
it is known and made durable (``fsync``). A rerun with the same ``out_dir`` skips what is done; a
run killed at any moment (SIGKILL included) leaves at most a partial last line, which is cut off
on restart (see :mod:`kvhive.evaluation.results`). The full cache is always evaluated once per
item (``method="full"``, budget 1.0) unless ``include_full=False``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from .backend import (
    DEFAULT_DTYPE,
    FULL_BUDGET,
    FULL_METHOD,
    Backend,
    Setting,
    SettingFailure,
    budget_key,
    budget_to_tokens,
    split_cache_options,
    validate_budgets,
    validate_dtype,
    with_cache_options,
)
from .environment import run_environment
from .memory import warn_if_above_full
from .results import RESULTS_FILE, TRANSIENT_STATUS, ResultsWriter
from .tasks import TASKS, Item, Task, get_task, parse_task_spec
from .tasks.base import encode

MethodValidator = Callable[[str], Any]
TOO_LONG_STATUS = "too_long"  # a prompt longer than the model's context that the task may not cut


class PendingItem(NamedTuple):
    """One item of the grid with the settings it still lacks (served by one backend call)."""

    task: Task
    item: Item
    settings: list[Setting]


# ``executor(work, writer, bar, fields)`` runs the pending items somewhere else and appends their
# records through ``writer`` (the only writer of results.jsonl), advancing ``bar`` (or None);
# ``fields`` are the run's model, seed, limit and suite; returns the number of records written.
ItemExecutor = Callable[[list[PendingItem], ResultsWriter, Any, dict], int]


@dataclass
class EvalRun:
    """What :func:`run_eval` did."""

    results_path: Path
    total: int  # results in the grid
    skipped: int  # already in results.jsonl before this run
    written: int  # appended by this run
    transient: int = 0  # results of the grid whose latest record is transient: a rerun retries them
    # Lines of results.jsonl this run dropped before appending ("<file>: line N: why"): an incomplete
    # last record (a writer stopped mid-line), whose setting the run computed again.
    dropped: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- argument resolution


def resolve_tasks(tasks: Sequence[str | Task] | str) -> list[Task]:
    """Task names / specs (``"needle:lengths=256+512"``) / instances -> Task instances."""
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t.strip()]
    resolved: list[Task] = []
    for task in tasks:
        if isinstance(task, Task):
            resolved.append(task)
        elif isinstance(task, str):
            name, params = parse_task_spec(task)
            resolved.append(get_task(name, **params))
        else:
            raise ValueError(
                f"tasks: expected task names or Task objects, got {task!r}; known tasks: {', '.join(TASKS)}"
            )
    names = [t.name for t in resolved]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tasks: {duplicates} given more than once")
    if not resolved:
        raise ValueError(f"tasks: no task given; known tasks: {', '.join(TASKS)}")
    return resolved


def validate_out_dir(out_dir: str | Path) -> Path:
    """The output folder, refused before anything is computed when it cannot be one: a path that
    exists and is not a folder, or a name ending in ``.jsonl`` (the results file goes inside the
    folder, ``OUT/results.jsonl``; ``kvhive report`` would read such a name as the file)."""
    path = Path(out_dir)
    if path.suffix == ".jsonl":
        raise ValueError(
            f"out_dir (--out): {str(path)!r} ends in .jsonl; give the output folder (results go to "
            f"FOLDER/{RESULTS_FILE}), e.g. {str(path.with_suffix(''))!r}"
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"out_dir (--out): {str(path)!r} exists and is not a folder; give a folder")
    return path


def _per_task(value: Any, task: Task, what: str) -> Any:
    if isinstance(value, Mapping):
        if task.name not in value:
            raise ValueError(f"{what}: no entry for task {task.name!r} (given for {sorted(value)})")
        return value[task.name]
    return value


def validate_methods(methods: Sequence[str], method_validator: MethodValidator | None) -> list[str]:
    if isinstance(methods, str):
        methods = [m for m in methods.split(",") if m.strip()]
    out: list[str] = []
    for method in methods:
        if not isinstance(method, str) or not method.strip():
            raise ValueError(f"methods: {method!r} is not a method name")
        # Cache options (``:prefill_chunk=512``) are no method's: the validator sees the method alone.
        try:
            method, cache_options = split_cache_options(method.strip())
        except ValueError as error:
            raise ValueError(f"methods: {error}") from None
        if method_validator is not None and method != FULL_METHOD:
            try:
                accepted = method_validator(method)
            except Exception as error:  # a registry lookup raising KeyError, an option out of range, etc.
                raise ValueError(f"methods: invalid method {method!r} ({error})") from error
            if accepted is False:
                raise ValueError(f"methods: unknown method {method!r}")
            if isinstance(accepted, str):  # the validator's canonical spelling (options sorted)
                method = accepted
        method = with_cache_options(method, cache_options)
        if method not in out:
            out.append(method)
    return out


def settings_for(methods: Sequence[str], budgets: Sequence[float | int], include_full: bool) -> list[Setting]:
    """The grid of one task: the full cache once, then every (method, budget)."""
    settings = [Setting(FULL_METHOD, FULL_BUDGET)] if include_full or FULL_METHOD in methods else []
    settings += [Setting(m, b) for m in methods if m != FULL_METHOD for b in budgets]
    return settings


# --------------------------------------------------------------------------- helpers


class TransientFailure(SettingFailure):
    """A setting's output lost to a failure that may pass (out of memory): recorded
    ``transient``, so a rerun computes it again."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the host or a device running out of memory (``MemoryError``,
    ``torch.cuda.OutOfMemoryError`` and the like, told by name: this module imports no torch)."""
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"


def truncate_middle(prompt: str, tokenizer: Any, max_tokens: int) -> tuple[str, int]:
    """LongBench-style middle truncation to ``max_tokens`` tokens; returns (prompt, original length)."""
    ids = encode(tokenizer, prompt)
    if len(ids) <= max_tokens:
        return prompt, len(ids)
    half = max_tokens // 2
    kept = ids[:half] + ids[len(ids) - (max_tokens - half) :]
    return tokenizer.decode(kept), len(ids)


def _model_name(backend: Backend, model_name: str | None) -> str:
    if model_name:
        return model_name
    for attribute in ("model_name", "name"):
        value = getattr(backend, attribute, None)
        if isinstance(value, str) and value:
            return value
    return str(getattr(getattr(backend, "tokenizer", None), "name_or_path", "unknown"))


def _backend_setting(task: Task, item: Item, setting: Setting) -> Setting:
    """The setting as the backend sees it: streaming takes token budgets (ratios of the text)."""
    if task.kind == "perplexity" and setting.method != FULL_METHOD:
        return Setting(setting.method, budget_to_tokens(setting.budget, len(item.token_ids)))
    return setting


def _call_backend(backend: Backend, task: Task, item: Item, settings: list[Setting]) -> list[Any]:
    if task.kind == "generate":
        if any(setting.prefill_question for setting in settings):
            outputs = backend.generate(item.prompt, item.max_new_tokens, settings, question=item.question)
        else:
            outputs = backend.generate(item.prompt, item.max_new_tokens, settings)
    elif task.kind == "choice":
        outputs = backend.choice_loglikelihoods(item.prompt, list(item.choices), settings)
    elif task.kind == "perplexity":
        token_settings = [_backend_setting(task, item, s) for s in settings]
        prefill = item.metadata.get("prefill_tokens")
        if prefill is None:
            outputs = backend.streaming_nll(list(item.token_ids), token_settings)
        else:  # a prompt in one forward, then its continuation token by token
            outputs = backend.streaming_nll(list(item.token_ids), token_settings, prefill_tokens=int(prefill))
    else:
        raise ValueError(f"task {task.name!r}: unknown kind {task.kind!r}")
    outputs = list(outputs)
    if len(outputs) != len(settings):
        raise RuntimeError(
            f"backend returned {len(outputs)} outputs for {len(settings)} settings ({task.name}/{item.id})"
        )
    return outputs


def _finite_or_none(value: float) -> float | None:
    """A number as JSON can hold it: non-finite values (refused by ``allow_nan=False``) become null."""
    value = float(value)
    return value if math.isfinite(value) else None


def _json_output(kind: str, output: Any) -> Any:
    if kind == "perplexity":
        nll_sum, n_tokens = output
        return [_finite_or_none(nll_sum), int(n_tokens)]
    if kind == "choice":
        return [_finite_or_none(x) for x in output]
    return output


def _output_problem(kind: str, output: Any) -> str | None:
    """Why an output cannot be scored (a non-finite log-likelihood or NLL), or None."""
    if kind == "perplexity":
        nll_sum, n_tokens = output
        if not math.isfinite(float(nll_sum)):
            return f"non-finite model output: NLL sum {float(nll_sum)!r} over {int(n_tokens)} tokens"
        if int(n_tokens) < 1:
            return "no token was predicted"
    elif kind == "choice":
        bad = [i for i, x in enumerate(output) if not math.isfinite(float(x))]
        if bad:
            return f"non-finite model output: log-likelihood of choice(s) {bad} is {[float(output[i]) for i in bad]}"
    return None


def _metrics_problem(metrics: Mapping[str, Any]) -> str | None:
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    return f"non-finite metrics {bad}" if bad else None


def _write_run_config(out_dir: Path, config: dict) -> None:
    tmp = out_dir / "run_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, default=str))
    os.replace(tmp, out_dir / "run_config.json")


def _check_items_unchanged(records: list[dict], loaded: list, path: Path) -> None:
    """Refuse to resume when an item id now denotes different content (task parameters, data or
    prompt code changed): its old results would be mixed with new ones."""
    previous = {(r["task"], str(r["item_id"])): r.get("item_hash") for r in records if r.get("item_hash")}
    if not previous:
        return
    changed = [
        f"{task.name}/{item.id}"
        for task, items, _ in loaded
        for item in items
        if previous.get((task.name, item.id), item.fingerprint()) != item.fingerprint()
    ]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise ValueError(
            f"{path} holds results for items that are now different ({shown}): task parameters, data or "
            f"prompts changed since; use another out dir"
        )


# --------------------------------------------------------------------------- main entry


def run_eval(
    backend: Backend,
    tasks: Sequence[str | Task] | str,
    methods: Sequence[str] | Mapping[str, Sequence[str]],
    budgets: Sequence[float | int] | Mapping[str, Sequence[float | int]] | None,
    limit: int | None,
    data_dir: str | Path | None,
    out_dir: str | Path,
    seed: int = 0,
    progress: bool = True,
    *,
    method_validator: MethodValidator | None = None,
    model_name: str | None = None,
    include_full: bool = True,
    suite: str | None = None,
    executor: ItemExecutor | None = None,
    dtype: str = DEFAULT_DTYPE,
) -> EvalRun:
    """Run (or resume) the grid task x item x (method, budget) and append to ``out_dir/results.jsonl``.

    ``tasks``: names, specs like ``"needle:lengths=256+512"``, or Task objects. ``methods`` and
    ``budgets`` are lists for all tasks or dicts ``{task name: list}``; ``budgets=None`` uses each
    task's ``default_budgets``. Budgets: floats in (0, 1] are ratios, ints >= 1 are tokens per head.
    ``method_validator(name)`` (e.g. the method registry's lookup) may raise or return False for
    unknown methods. Results of another model, seed or ``dtype`` (the model's weights and
    activations, recorded with every result) in ``out_dir`` are refused.
    ``executor`` runs the pending items elsewhere (:mod:`kvhive.evaluation.distributed`); then
    ``backend`` only has to provide the tokenizer (to load the items) and the model name.
    """
    validate_dtype(dtype)
    validate_out_dir(out_dir)
    resolved_tasks = resolve_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit: expected an integer >= 0 or None, got {limit!r}")
    plans: list[tuple[Task, list[Setting]]] = []
    for task in resolved_tasks:
        task_methods = validate_methods(_per_task(methods, task, "methods"), method_validator)
        task_budgets = _per_task(budgets, task, "budgets") if budgets is not None else None
        task_budgets = validate_budgets(list(task.default_budgets) if task_budgets is None else list(task_budgets))
        plans.append((task, settings_for(task_methods, task_budgets, include_full)))

    name = _model_name(backend, model_name)
    tokenizer = backend.tokenizer
    loaded = [(task, task.load(data_dir, limit, seed, tokenizer), settings) for task, settings in plans]

    out_path = Path(out_dir)
    with ResultsWriter(out_path) as writer:
        others = {(r.get("model"), r.get("seed"), r.get("dtype", DEFAULT_DTYPE)) for r in writer.records} - {
            (name, seed, dtype)
        }
        if others:
            raise ValueError(
                f"{writer.path} already holds results of (model, seed, dtype) {sorted(map(str, others))}; "
                f"this run is model={name!r}, seed={seed}, dtype={dtype!r}: use another out dir"
            )
        _check_items_unchanged(writer.records, loaded, writer.path)
        _write_run_config(
            out_path,
            {
                "model": name,
                "seed": seed,
                "limit": limit,
                "suite": suite,
                "dtype": dtype,
                "data_dir": str(data_dir) if data_dir is not None else None,
                "tasks": [{"name": t.name, "params": t.params, "settings": [s.label for s in ss]} for t, ss in plans],
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                **run_environment(),  # the code and package versions behind the results
            },
        )
        total = sum(len(items) * len(settings) for _, items, settings in loaded)
        skipped = sum(
            (task.name, item.id, s.method, budget_key(s.budget)) in writer.done
            for task, items, settings in loaded
            for item in items
            for s in settings
        )
        written = 0
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=skipped, desc="eval", unit="result", dynamic_ncols=True)
        try:
            work = []
            for task, items, settings in loaded:
                for item in items:
                    pending = [
                        s for s in settings if (task.name, item.id, s.method, budget_key(s.budget)) not in writer.done
                    ]
                    if pending:
                        work.append(PendingItem(task, item, pending))
            if executor is not None:
                fields = {"model": name, "seed": seed, "limit": limit, "suite": suite, "dtype": dtype}
                written = executor(work, writer, bar, fields)
            else:
                for task, item, pending in work:
                    if bar is not None:
                        bar.set_postfix_str(f"{task.name} {item.id}", refresh=False)
                    written += run_item(backend, task, item, pending, writer, name, seed, limit, suite, dtype)
                    if bar is not None:
                        bar.update(len(pending))
        finally:
            if bar is not None:
                bar.close()
        grid_keys = {
            (task.name, item.id, s.method, budget_key(s.budget))
            for task, items, settings in loaded
            for item in items
            for s in settings
        }
        transient = len(writer.transient & grid_keys)
    return EvalRun(
        results_path=out_path / RESULTS_FILE,
        total=total,
        skipped=skipped,
        written=written,
        transient=transient,
        dropped=[str(line) for line in writer.dropped],
    )


def run_item(
    backend: Backend,
    task: Task,
    item: Item,
    pending: list[Setting],
    writer: ResultsWriter,
    model: str,
    seed: int,
    limit: int | None,
    suite: str | None,
    dtype: str = DEFAULT_DTYPE,
    record_out_of_memory: bool = True,
) -> int:
    """Run one item's pending settings (one backend call) and append their records.

    Running out of memory is recorded ``transient`` (a rerun retries it) when
    ``record_out_of_memory``; else it raises (a Ray worker: the pool retries the item elsewhere)."""
    metadata = dict(item.metadata)
    item_hash = item.fingerprint()
    prompt_tokens = None
    too_long = None  # why the prompt cannot be given to the model, when it cannot
    if task.kind in ("generate", "choice"):
        max_context = getattr(backend, "max_context", None)
        prompt_tokens = len(encode(backend.tokenizer, item.prompt))
        # room for the special tokens the backend adds, and for the generated (or scored) tokens
        reserve = 8 + (
            item.max_new_tokens
            if task.kind == "generate"
            else max(len(encode(backend.tokenizer, c)) for c in item.choices)
        )
        if max_context and prompt_tokens > int(max_context) - reserve:
            limit_tokens = int(max_context) - reserve
            shortened = (
                task.shorten(item, backend.tokenizer, limit_tokens)
                if task.kind == "generate" and limit_tokens >= 1
                else None
            )
            if shortened is None:
                too_long = (
                    f"prompt of {prompt_tokens} tokens does not fit the model's context of {int(max_context)} "
                    f"tokens ({reserve} kept for the special and the {'generated' if task.kind == 'generate' else 'scored'} tokens); "
                    f"task {task.name!r} allows no cut (what is cut could be what is asked)"
                )
            else:
                metadata = {
                    **dict(shortened.metadata),
                    "truncated_from_tokens": prompt_tokens,
                    "truncated": task.truncatable,
                }
                item = shortened
    else:
        prompt_tokens = len(item.token_ids)

    # A ratio budget can resolve below what a method needs on a short context (SnapKV's window on
    # a 100-token prompt): that setting is recorded as infeasible, the others still run. A method
    # that cannot keep its budget in the task's phase (a prefill-only method on a token stream)
    # is recorded as not applicable: scoring it would report the full cache under its name.
    if task.kind == "perplexity":
        context_tokens = len(item.token_ids)
    else:  # as the backend tokenizes it: with the tokenizer's special tokens (BOS)
        context_tokens = len(backend.tokenizer(item.prompt)["input_ids"])
    infeasible = getattr(backend, "infeasible", None)
    not_applicable = getattr(backend, "not_applicable", None)
    reasons: dict[Setting, tuple[str, str]] = {}
    for setting in pending:
        if too_long is not None:
            reasons[setting] = (TOO_LONG_STATUS, too_long)
            continue
        if (
            task.kind == "perplexity"
            and setting.method != FULL_METHOD
            and isinstance(setting.budget, float)
            and round(setting.budget * len(item.token_ids)) < 1
        ):
            # Converting to tokens would silently raise it to 1 token.
            reasons[setting] = (
                "infeasible",
                f"budget ratio={setting.budget:g} of a {len(item.token_ids)}-token text is 0 tokens",
            )
            continue
        if setting.prefill_question and (task.kind != "generate" or not item.question):
            reasons[setting] = (
                "not_applicable",
                f"prefill_question: task {task.name!r} separates no question from its prompts (a question-aware "
                "chunked prefill needs the prompt's final part that is its question)",
            )
            continue
        backend_setting = _backend_setting(task, item, setting)
        reason = infeasible(backend_setting, context_tokens) if infeasible is not None else None
        if reason:
            reasons[setting] = ("infeasible", str(reason))
            continue
        if not_applicable is not None:
            reason = not_applicable(backend_setting, context_tokens, task.kind == "perplexity")
            if reason:
                reasons[setting] = ("not_applicable", str(reason))
    feasible = [s for s in pending if s not in reasons]

    start = time.perf_counter()
    try:
        outputs = _call_backend(backend, task, item, feasible) if feasible else []
    except Exception as error:  # noqa: BLE001 - only running out of memory is recorded, the rest raises
        if not (record_out_of_memory and is_out_of_memory(error)):
            raise
        # Memory depends on what else the device holds: record it, let the grid go on, retry on rerun.
        text = str(error).strip().splitlines()
        reason = f"out of memory ({type(error).__name__}: {text[0] if text else ''}); a rerun retries it"
        outputs = [TransientFailure(reason)] * len(feasible)
    wall = time.perf_counter() - start
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results = dict(zip(feasible, outputs, strict=True))
    # Optional: the cache size each setting actually held (a backend attribute aligned with the call).
    sizes = getattr(backend, "last_cache_sizes", None) if feasible else None
    cache_sizes = (
        dict(zip(feasible, sizes, strict=True)) if isinstance(sizes, list) and len(sizes) == len(feasible) else {}
    )
    count = 0
    for setting in pending:
        output, metrics, status, reason = None, {}, "ok", None
        if setting in reasons:
            status, reason = reasons[setting]
        elif isinstance(results[setting], TransientFailure):
            status, reason = TRANSIENT_STATUS, results[setting].reason
        elif isinstance(results[setting], SettingFailure):
            status, reason = "failed", results[setting].reason
        else:
            output = results[setting]
            reason = _output_problem(task.kind, output)
            if reason is None:
                metrics = task.score(item, output)
                reason = _metrics_problem(metrics)
            if reason is not None:  # a number recorded is right or refused: never score NaN
                status, metrics = "failed", {}
        record = {
            "task": task.name,
            "item_id": item.id,
            "item_hash": item_hash,
            "method": setting.method,
            "budget": setting.budget,
            "setting": setting.label,
            "metrics": metrics,
            "output": None if output is None else _json_output(task.kind, output),
            "status": status,
            "kind": task.kind,
            "main_metric": task.main_metric,
            "higher_is_better": task.higher_is_better,
            "chance": None if isinstance(task.chance, float) and math.isnan(task.chance) else task.chance,
            "model": model,
            "seed": seed,
            "limit": limit,
            "suite": suite,
            "dtype": dtype,
            "task_params": task.params,
            "metadata": metadata,
            "prompt_tokens": prompt_tokens,
            "wall_s": round(wall, 4),
            "settings_in_call": len(feasible),
            "time": timestamp,
        }
        if setting.prefill_chunk is not None:  # also in the method's name: never mixed with a one-shot prefill
            record["prefill_chunk"] = setting.prefill_chunk
        if setting.prefill_question:
            record["prefill_question"] = True
        if setting.kv_bits is not None:  # also in the method's name: a setting of its own
            record["kv_bits"] = setting.kv_bits
        if cache_sizes.get(setting):
            record["cache"] = cache_sizes[setting]
            warn_if_above_full(task.name, setting.label, cache_sizes[setting])
        if status != "ok":
            record["reason"] = reason
            record["context_tokens"] = context_tokens
        if task.kind == "perplexity" and setting.method != FULL_METHOD:
            record["budget_tokens"] = budget_to_tokens(setting.budget, len(item.token_ids))
        writer.append(record)
        count += 1
    return count
