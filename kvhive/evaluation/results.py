"""``results.jsonl``: crash-safe appending, tolerant reading, and an aggregated view.

One JSON object per line, one line per (task, item, method, budget). Appends are single
``os.write`` calls on an ``O_APPEND`` descriptor followed by ``fsync``, so after a SIGKILL the
file holds whole lines plus at most one partial last line. Before a run appends again,
:func:`repair_results_file` settles a last line without a newline: a complete record (written by
another tool, or a newline lost) gets its newline and is kept; only a line that does not parse is
cut off, with a warning naming the file and line. Readers do the same without writing: they keep
a complete last record and skip, with a warning (:class:`ResultsLineSkipped`), a line that does
not parse. An exclusive ``flock`` on ``OUT/.results.lock`` keeps two runs from writing the same
file at once.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backend import FULL_METHOD, budget_key
from .metrics import aggregate_item_metrics

RESULTS_FILE = "results.jsonl"
LOCK_FILE = ".results.lock"

# A setting that could not be computed for a reason that may pass (its Ray worker died, the
# device ran out of memory): recorded so that the report counts it, but not done: a rerun
# computes it again and the new record replaces it ("the latest record for a key wins").
TRANSIENT_STATUS = "transient"
# Statuses of a setting that has no score by design, listed apart in the report: its budget is
# below the method's minimum there, or the method cannot keep a budget in the task's phase.
EXPECTED_UNSCORED = ("infeasible", "not_applicable")


def results_path(out_dir: str | Path) -> Path:
    path = Path(out_dir)
    return path if path.suffix == ".jsonl" and not path.is_dir() else path / RESULTS_FILE


def is_done(record: dict) -> bool:
    """Whether a record settles its key (every status but ``transient``, which a rerun retries)."""
    return record.get("status", "ok") != TRANSIENT_STATUS


def _metrics_problem(record: dict) -> str | None:
    """Why a record's metrics cannot be read as numbers (a value that is not a number or null)."""
    metrics = record.get("metrics", {})
    if not isinstance(metrics, dict):
        return f"metrics is {type(metrics).__name__}, expected an object"
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"metric {name!r} is {value!r}, not a number"
    return None


def result_key(record: dict) -> tuple[str, str, str, str]:
    """Identity of a result: (task, item id, method, canonical budget)."""
    return (record["task"], str(record["item_id"]), record["method"], budget_key(record["budget"]))


class ResultsLineSkipped(UserWarning):
    """A line of ``results.jsonl`` that is not a record was skipped (or, by a run, dropped)."""


@dataclass(frozen=True)
class SkippedLine:
    """A line of ``results.jsonl`` that holds no record: its number (from 1) and why."""

    path: Path
    number: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: line {self.number}: {self.reason}"


# What readers catch when a line is not a record: not JSON, not UTF-8, or JSON without a key's fields.
_NOT_A_RECORD = (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError)


def _parse_record(line: bytes) -> tuple[dict, tuple] | None:
    """``(record, key)`` of one line, or None when it is not a record."""
    try:
        record = json.loads(line)
        return record, result_key(record)
    except _NOT_A_RECORD:
        return None


def settle_last_line(path: Path) -> SkippedLine | None:
    """Settle a last line without a trailing newline: a complete record gets its newline (kept, so
    a rerun neither loses nor recomputes it); a line that does not parse (a writer killed mid-line)
    is cut off and returned, with the bytes dropped in its reason; None when nothing was dropped."""
    if not path.exists():
        return None
    with open(path, "r+b") as handle:
        data = handle.read()
        if not data or data.endswith(b"\n"):
            return None
        keep = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
        dropped = None
        if _parse_record(data[keep:]) is not None:
            handle.write(b"\n")  # the file position is at its end after the read
        else:
            handle.truncate(keep)
            if data[keep:].strip():  # (trailing blanks are no record: cut without a word)
                reason = (
                    f"dropped {len(data) - keep} bytes, an incomplete last record (a writer stopped mid-line); "
                    "its setting is computed again"
                )
                dropped = SkippedLine(path, data.count(b"\n") + 1, reason)
        handle.flush()
        os.fsync(handle.fileno())
        return dropped


def repair_results_file(path: Path) -> int:
    """:func:`settle_last_line` with a :class:`ResultsLineSkipped` warning naming the file and line
    it dropped; returns the number of bytes removed (0 when the last line was kept)."""
    before = path.stat().st_size if path.exists() else 0
    dropped = settle_last_line(path)
    if dropped is not None:
        warnings.warn(str(dropped), ResultsLineSkipped, stacklevel=2)
    return max(0, before - (path.stat().st_size if path.exists() else 0))


def scan_results(out_dir: str | Path) -> tuple[list[dict], list[SkippedLine]]:
    """All records, one per key (the latest record of a key wins, at the place of the key's first
    record), and the lines that hold no record: a malformed line, or a last line without a newline
    that does not parse (a writer killed mid-line; a complete last record is kept). A record whose
    metrics are not numbers raises ``ValueError`` naming the file and line (averaging it would
    either crash or report a number that is not what it says)."""
    path = results_path(out_dir)
    if not path.exists():
        return [], []
    data = path.read_bytes()
    lines = data.split(b"\n")
    records: list[dict] = []
    skipped: list[SkippedLine] = []
    index_of: dict[tuple, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = _parse_record(line)
        if parsed is None:
            last = number == len(lines)  # no newline after it
            reason = "incomplete last record (a writer stopped mid-line)" if last else "malformed record"
            skipped.append(SkippedLine(path, number, reason))
            continue
        record, key = parsed
        problem = _metrics_problem(record)
        if problem is not None:
            raise ValueError(f"{path}: line {number}: {problem}")
        if key in index_of:
            records[index_of[key]] = record
            continue
        index_of[key] = len(records)
        records.append(record)
    return records, skipped


def read_results(out_dir: str | Path) -> list[dict]:
    """The records of :func:`scan_results`; each line that holds no record is skipped with a
    :class:`ResultsLineSkipped` warning naming the file and line."""
    records, skipped = scan_results(out_dir)
    for line in skipped:
        warnings.warn(f"{line}: skipped", ResultsLineSkipped, stacklevel=2)
    return records


class ResultsLockedError(RuntimeError):
    """Another run is writing to the same ``results.jsonl``."""


class ResultsWriter:
    """Exclusive appender for ``OUT/results.jsonl`` (use as a context manager)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / RESULTS_FILE
        self._lock_fd = os.open(self.out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ResultsLockedError(
                f"another evaluation run is writing to {self.path}; wait for it or use another --out"
            ) from None
        # A last line without a newline: kept when it is a complete record, else dropped and said.
        self.dropped: list[SkippedLine] = []
        dropped = settle_last_line(self.path)
        if dropped is not None:
            warnings.warn(str(dropped), ResultsLineSkipped, stacklevel=2)
            self.dropped.append(dropped)
        self.records = read_results(self.path)
        # Keys a rerun skips; a key whose latest record is transient is retried.
        self.done = {result_key(r) for r in self.records if is_done(r)}
        self.transient = {result_key(r) for r in self.records if not is_done(r)}
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        """Write one record as one line and make it durable before returning.

        A key already settled is not written again; a key whose record is transient is: the new
        record replaces it (here and, the latest line winning, for every reader)."""
        key = result_key(record)
        if key in self.done:
            return
        # allow_nan=False: a NaN or infinity anywhere refuses to be written (bare NaN is not JSON,
        # and a non-finite number must be recorded as a failure, never as a score).
        data = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        written = 0
        while written < len(data):  # os.write may be partial for huge records
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)
        if key in self.transient:  # replaced (rare: a rerun of what a dead worker left)
            self.records = [r for r in self.records if result_key(r) != key]
            self.transient.discard(key)
        if is_done(record):
            self.done.add(key)
        else:
            self.transient.add(key)
        self.records.append(record)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ResultsSummary:
    """Aggregated view of result records: per (task, method, budget) the task's aggregate metrics.

    The full cache is ``method == "full"`` at any budget (the runner records it at budget 1.0).
    """

    def __init__(self, records: Iterable[dict]) -> None:
        self.records = list(records)
        self._groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        self._budgets: dict[str, float | int] = {}
        self.task_info: dict[str, dict[str, Any]] = {}
        # Settings that produced no score on an item are kept apart: "infeasible" (budget below the
        # method's minimum), "not_applicable" (the method cannot keep its budget in the task's
        # phase), "failed" (non-finite model output), "transient" (a dead worker: retried on rerun),
        # "too_long" (a prompt that does not fit the model). They never count as a score.
        self._unscored: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        for record in self.records:
            key = (record["task"], record["method"], budget_key(record["budget"]))
            if record.get("status", "ok") != "ok":
                self._unscored[key].append(record)
                self._budgets.setdefault(key[2], record["budget"])
                continue
            self._groups[key].append(record)
            self._budgets[key[2]] = record["budget"]
            info = self.task_info.setdefault(
                record["task"],
                {
                    "kind": record.get("kind", "generate"),
                    "main_metric": record.get("main_metric") or next(iter(record.get("metrics", {})), None),
                    "higher_is_better": record.get("higher_is_better", True),
                    "chance": record.get("chance"),
                },
            )
            if info["chance"] is None and record.get("chance") is not None:
                info["chance"] = record["chance"]
        # A task none of whose items has a score (every prompt too long, every worker dead) still
        # has its section in the report, which says why.
        for record in (r for rs in self._unscored.values() for r in rs):
            self.task_info.setdefault(
                record["task"],
                {
                    "kind": record.get("kind", "generate"),
                    "main_metric": record.get("main_metric"),
                    "higher_is_better": record.get("higher_is_better", True),
                    "chance": record.get("chance"),
                },
            )
        self._cache: dict[tuple, dict[str, float]] = {}

    def unscored_settings(self, task: str, status: str | None = None) -> list[tuple[str, float | int, str, int, str]]:
        """(method, budget, status, number of items, first reason) of settings that produced no
        score on some items of ``task`` (``status``: only that one, e.g. "failed")."""
        grouped: dict[tuple, list[dict]] = defaultdict(list)
        for (t, method, key), records in self._unscored.items():
            for record in records:
                if t == task and (status is None or record["status"] == status):
                    grouped[(method, key, record["status"])].append(record)
        out = [
            (method, self._budgets[key], record_status, len(records), records[0].get("reason", record_status))
            for (method, key, record_status), records in grouped.items()
        ]
        return sorted(out, key=lambda row: (row[0], isinstance(row[1], int), float(row[1]), row[2]))

    def task_item_ids(self, task: str) -> set[str]:
        """Every item of ``task`` that has a record, in any setting and with any status."""
        return {str(r["item_id"]) for r in self.records if r["task"] == task}

    def problems_note(self, task: str, settings: Iterable[tuple[str, float | int | None]]) -> str:
        """One line naming the compared settings of ``task`` that lack scores for some items
        (failed, transient, too long, missing), or ``""``: a verdict built on them says so."""
        parts = []
        for method, budget in settings:
            found = self.cell_problems(task, method, budget)
            if found:
                label = method if method == FULL_METHOD or budget is None else f"{method}@{budget_key(budget)}"
                parts.append(f"{label} " + ", ".join(f"{count} {status}" for status, count, _ in found))
        return f"items without a score, left out: {'; '.join(parts)}" if parts else ""

    def settings_with_records(self, task: str) -> list[tuple[str, float | int | None]]:
        """(method, budget) of every setting of ``task`` with a record of any status (the full
        cache as ``(FULL_METHOD, None)``), scored or not."""
        keys = {(m, None if m == FULL_METHOD else b) for (t, m, b) in [*self._groups, *self._unscored] if t == task}
        return sorted(
            ((m, None if b is None else self._budgets[b]) for m, b in keys),
            key=lambda s: (s[0] != FULL_METHOD, s[0], s[1] is not None and isinstance(s[1], int), float(s[1] or 0)),
        )

    def cell_problems(self, task: str, method: str, budget: float | int | None = None) -> list[tuple[str, int, str]]:
        """``(status, items, first reason)`` for the items of ``task`` that (method, budget) has
        no score for although they were meant to have one: ``failed`` (deterministic: non-finite
        output), ``transient`` (a worker died, out of memory: a rerun retries it), ``too_long``
        (the prompt does not fit the model and the task allows no cut there) and ``missing``
        (items other settings of the task have, this one has no record of: an interrupted run
        or another ``--limit``). ``infeasible`` and ``not_applicable`` settings are listed apart
        (:meth:`unscored_settings`). Empty when the cell is complete."""
        if method == FULL_METHOD or budget is None:
            unscored = [r for (t, m, _), rs in self._unscored.items() if t == task and m == method for r in rs]
        else:
            unscored = list(self._unscored.get((task, method, budget_key(budget)), []))
        recorded = {str(r["item_id"]) for r in unscored} | set(self.item_ids(task, method, budget))
        problems: dict[str, list[str]] = defaultdict(list)
        for record in unscored:
            if record["status"] not in EXPECTED_UNSCORED:
                problems[record["status"]].append(str(record.get("reason", record["status"])))
        missing = self.task_item_ids(task) - recorded
        if missing:
            shown = ", ".join(sorted(missing)[:3]) + (", …" if len(missing) > 3 else "")
            problems["missing"] = [f"no record for item(s) {shown}"] * len(missing)
        return [(status, len(reasons), reasons[0]) for status, reasons in sorted(problems.items())]

    def infeasible_settings(self, task: str) -> list[tuple[str, float | int, int, str]]:
        """(method, budget, number of items, first reason) of settings that could not run on
        some items of ``task`` (budget below the method's minimum)."""
        return [(m, b, n, reason) for m, b, _, n, reason in self.unscored_settings(task, "infeasible")]

    def infeasible(self, task: str, method: str, budget: float | int) -> list[str]:
        """Reasons recorded for items on which (method, budget) could not run (budget below its minimum)."""
        records = self._unscored.get((task, method, budget_key(budget)), [])
        return [r.get("reason", "infeasible") for r in records if r["status"] == "infeasible"]

    def item_ids(self, task: str, method: str, budget: float | int | None = None) -> list[str]:
        """Ids of the items (method, budget) has a score for, so comparisons can be paired."""
        return [str(r["item_id"]) for r in self.item_records(task, method, budget)]

    # -- structure
    def tasks(self) -> list[str]:
        return list(self.task_info)

    def methods(self, task: str) -> list[str]:
        return sorted({m for (t, m, _) in self._groups if t == task})

    def budgets(self, task: str, method: str | None = None) -> list[float | int]:
        keys = {b for (t, m, b) in self._groups if t == task and (method is None or m == method)}
        return sorted((self._budgets[k] for k in keys), key=lambda b: (isinstance(b, int), float(b)))

    def item_records(self, task: str, method: str, budget: float | int | None = None) -> list[dict]:
        if budget is None or method == FULL_METHOD:
            return [r for (t, m, _), rs in self._groups.items() if t == task and m == method for r in rs]
        return list(self._groups.get((task, method, budget_key(budget)), []))

    # -- numbers
    def aggregate(self, task: str, method: str, budget: float | int | None = None) -> dict[str, float]:
        key = (task, method, None if method == FULL_METHOD or budget is None else budget_key(budget))
        if key not in self._cache:
            records = self.item_records(task, method, budget)
            kind = self.task_info.get(task, {}).get("kind", "generate")
            self._cache[key] = aggregate_item_metrics(kind, [r["metrics"] for r in records]) if records else {}
        return self._cache[key]

    def mean_kept_per_head(self, task: str, method: str, budget: float | int | None = None) -> float | None:
        """Tokens the cache actually held per head, averaged over the run and the items (None when
        the backend did not report it)."""
        values = [
            r["cache"]["mean_kept_per_head"]
            for r in self.item_records(task, method, budget)
            if isinstance(r.get("cache"), dict) and "mean_kept_per_head" in r["cache"]
        ]
        return sum(values) / len(values) if values else None

    def main_metric(self, task: str) -> str | None:
        return self.task_info.get(task, {}).get("main_metric")

    def value(
        self, task: str, method: str, budget: float | int | None = None, metric: str | None = None
    ) -> float | None:
        metric = metric or self.main_metric(task)
        value = self.aggregate(task, method, budget).get(metric) if metric else None
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value

    def count(self, task: str, method: str, budget: float | int | None = None) -> int:
        return len(self.item_records(task, method, budget))

    def full(self, task: str, metric: str | None = None) -> float | None:
        return self.value(task, FULL_METHOD, None, metric)

    def near_chance(self, task: str, margin: float = 0.05) -> bool | None:
        """True when the full-cache main metric is within ``margin`` of the task's chance level
        (absolute for higher-is-better metrics; relative for perplexity). None if unknown."""
        info = self.task_info.get(task, {})
        chance = info.get("chance")
        full = self.full(task)
        if full is None or chance is None or (isinstance(chance, float) and math.isnan(chance)):
            return None
        if info.get("higher_is_better", True):
            return full <= chance + margin
        return full >= chance * (1 - margin)
