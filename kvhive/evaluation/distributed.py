"""The evaluation grid on a Ray cluster: ``kvhive eval ... --ray [ADDRESS] --workers N``.

Items are independent, so the grid spreads over Ray actors (:class:`EvalWorker`), each holding
one loaded model (one GPU per actor when the cluster has GPUs, else a share of its CPUs). Every
pending (method, budget) of an item still goes to ONE backend call on one worker (one shared
prefill), through the same per-item code as the single-process run
(:func:`kvhive.evaluation.runner.run_item`), so the records are the same. Records stream back
to the driver, the only process that appends to ``results.jsonl``: same ``fsync`` per line, same
lock, same resume (a killed driver loses nothing written and a rerun duplicates nothing).

A worker that dies (its process killed, its node lost) or raises (CUDA out of memory, a crash in
a kernel) has its item retried on another worker, at most ``max_attempts`` times in all; then every
pending setting of that item is recorded with ``status="transient"`` and the ``reason``, and the
grid goes on: the report counts those items, and a rerun of the same command retries them (the
new record replaces the transient one). Invalid input (``ValueError``/``TypeError``) stops the run with that error instead, as in
one process: retrying it cannot help. A dead worker is replaced by a
fresh one (at most ``workers * max_attempts`` replacements, so a model that cannot load ends the
run with an error instead of looping). Ray is an optional dependency (``pip install
'kvhive[ray]'``); it is imported only when this runner is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .backend import DEFAULT_DTYPE, Backend, Setting
from .results import TRANSIENT_STATUS, ResultsWriter
from .runner import EvalRun, MethodValidator, PendingItem, run_eval, run_item
from .tasks import Task

INSTALL_HINT = "Ray is not installed: pip install 'kvhive[ray]' (or pip install 'ray>=2.9')"
DEFAULT_MAX_ATTEMPTS = 3
FAILED_STATUS = TRANSIENT_STATUS  # what an item that exhausted its attempts is recorded as
# Raised for invalid input (a budget a method refuses, a prompt longer than the model's context):
# retrying cannot help and the single-process run stops on them, so the distributed run stops too.
INVALID_INPUT_ERRORS = (ValueError, TypeError)


PROBE_TIMEOUT_S = 5.0  # how long joining a cluster may take to answer before it counts as unreachable


class RayClusterError(RuntimeError):
    """The Ray cluster cannot be reached, or every worker died: the run cannot go on (what is
    finished is in results.jsonl; the message says what to do)."""


def probe_address(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`RayClusterError` when ``HOST:PORT`` (or ``ray://HOST:PORT``) does not accept
    a connection within ``timeout`` seconds: ``ray.init`` would wait minutes on it. Other
    addresses (``auto``) are left to Ray, which answers them at once."""
    target = address.removeprefix("ray://")
    host, separator, port = target.rpartition(":")
    if not separator or not port.isdigit():
        return
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        reason = "timed out" if isinstance(error, TimeoutError) else (error.strerror or type(error).__name__)
        raise RayClusterError(
            f"cannot reach the Ray cluster at {address} ({reason} within {timeout:g} s): start it there with "
            "`ray start --head`, check the address, or give --ray alone for a local instance"
        ) from None


@contextlib.contextmanager
def _loopback_node(ray: Any):
    """A local Ray instance whose processes listen on the loopback only, not on every interface
    (Ray's default): Ray picks the loopback as the node address where it treats the machine as
    a one-node cluster, which this switch (read by ``ray._private.services``) selects."""
    constants = ray._private.ray_constants
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def require_ray():
    """The ``ray`` module, or ImportError with the one line saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return ray


# --------------------------------------------------------------------------- worker side


class EvalWorker:
    """One Ray actor: loads the backend once (``start``), then serves items (``run_item``)."""

    def __init__(self, backend_factory: Callable[[str], Backend], model_name: str, threads: int | None = None) -> None:
        self.backend_factory = backend_factory
        self.model_name = model_name
        self.threads = threads
        self.backend: Backend | None = None

    def start(self) -> dict[str, Any]:
        """Load the model; returns what the driver needs to load the items (the tokenizer)."""
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)  # the actor's share of the node's cores
        self.backend = self.backend_factory(self.model_name)
        return {
            "tokenizer": self.backend.tokenizer,
            "model_name": getattr(self.backend, "model_name", None),
            "pid": os.getpid(),
        }

    def run_item(self, task: Task, item: Any, settings: list[Setting], fields: dict) -> list[dict]:
        """The records of one item's pending settings (one backend call), as the local run makes them."""
        if self.backend is None:
            raise RuntimeError("EvalWorker.run_item called before start()")
        records: list[dict] = []  # run_item appends each record to its "writer": here, a list
        run_item(
            self.backend,
            task,
            item,
            list(settings),
            records,
            fields["model"],
            fields["seed"],
            fields["limit"],
            fields["suite"],
            fields.get("dtype", DEFAULT_DTYPE),
            record_out_of_memory=False,  # raised: the pool retries the item on another worker first
        )
        return records

    def pid(self) -> int:
        return os.getpid()


def failed_records(entry: PendingItem, fields: dict, reason: str, attempts: int) -> list[dict]:
    """One ``status="transient"`` record per pending setting of an item that could not be run
    (retried by a rerun)."""
    task, item = entry.task, entry.item
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return [
        {
            "task": task.name,
            "item_id": item.id,
            "item_hash": item.fingerprint(),
            "method": setting.method,
            "budget": setting.budget,
            "setting": setting.label,
            "metrics": {},
            "output": None,
            "status": FAILED_STATUS,
            "reason": reason,
            "attempts": attempts,
            "kind": task.kind,
            "main_metric": task.main_metric,
            "higher_is_better": task.higher_is_better,
            "chance": task.chance if task.chance == task.chance else None,  # NaN chance -> None, as the runner
            **fields,
            "task_params": task.params,
            "metadata": dict(item.metadata),
            "time": timestamp,
        }
        for setting in entry.settings
    ]


# --------------------------------------------------------------------------- driver side


@dataclass
class _Job:
    entry: PendingItem
    attempts: int = 0
    failed_on: set = field(default_factory=set)  # worker numbers this item already failed on
    last_reason: str = ""


@dataclass
class _Worker:
    number: int
    actor: Any
    started: bool = False


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip().rstrip(":")


class RayPool:
    """Ray actors holding the model, and the :data:`~kvhive.evaluation.runner.ItemExecutor` that
    feeds them. Also stands in for the backend on the driver: ``tokenizer`` (fetched from the first
    worker, which starts the pool on first use, after the grid has been validated) and
    ``model_name``. Use as a context manager: leaving it kills the actors and stops a Ray instance
    it started."""

    def __init__(
        self,
        backend_factory: Callable[[str], Backend],
        model_name: str,
        workers: int | None = None,
        address: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        init_options: Mapping[str, Any] | None = None,
    ) -> None:
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(
                f"workers: expected an integer >= 1 (or None: one per GPU, else one per CPU), got {workers!r}"
            )
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts: expected an integer >= 1, got {max_attempts!r}")
        self.ray = require_ray()
        self.backend_factory = backend_factory
        self.model_name = model_name
        self.requested_workers = workers
        self.address = address
        self.max_attempts = max_attempts
        self.init_options = dict(init_options or {})
        self._started_ray = False
        self._workers: dict[int, _Worker] = {}
        self._next_number = 0
        self._tokenizer = None
        self._pending_starts: dict[Any, _Worker] = {}
        self.replacements = 0
        self.worker_deaths = 0
        self.item_errors = 0

    # -- backend stand-in ------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        self._ensure_started()
        return self._tokenizer

    # -- lifecycle ---------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._workers:
            return
        ray = self.ray
        if not ray.is_initialized():
            options = {"include_dashboard": False, "logging_level": logging.WARNING, **self.init_options}
            if self.address is None:
                # a fresh local instance; worker logs stay in Ray's session folder, off the progress bar
                options.setdefault("log_to_driver", False)
                options.setdefault("_node_ip_address", "127.0.0.1")
                with _loopback_node(ray):
                    ray.init(address="local", **options)
            else:
                probe_address(self.address)
                try:
                    ray.init(address=self.address, **options)
                except ConnectionError as error:  # e.g. "auto" with no cluster running
                    raise RayClusterError(f"cannot reach the Ray cluster at {self.address}: {error}") from None
            self._started_ray = True
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        self.workers = self.requested_workers or (gpus or max(1, cpus))
        if gpus:
            self._actor_options, threads = {"num_gpus": 1, "num_cpus": 1}, None
        else:
            share = max(1, cpus // self.workers)
            self._actor_options, threads = {"num_cpus": share}, share
        if self.workers > (gpus or cpus):
            unit = "GPUs" if gpus else "CPUs"
            raise ValueError(
                f"workers: {self.workers} workers need {self.workers} {unit} but the Ray cluster has {gpus or cpus}; "
                f"give --workers <= {gpus or cpus}"
            )
        self._threads = threads
        self._actor_class = ray.remote(EvalWorker)
        # One worker first: the driver needs its tokenizer to see what is pending; the others start
        # once there is work for them (a rerun with nothing left starts one).
        self._spawn()
        while self._tokenizer is None:
            ready, _ = ray.wait(list(self._pending_starts), num_returns=1)
            worker = self._pending_starts.pop(ready[0])
            try:
                info = ray.get(ready[0])
            except self.ray.exceptions.RayTaskError as error:  # the backend factory raised: a user error
                cause = error.cause if isinstance(error.cause, Exception) else error
                raise cause from None
            except self.ray.exceptions.RayError as error:
                self._lose(worker, error)
                if not self._workers and not self._pending_starts:
                    raise RayClusterError(
                        f"no Ray worker could start: {_short(error)}; check that the model loads in one process "
                        "(kvhive eval without --ray)"
                    ) from None
                continue
            worker.started = True
            self._tokenizer = info["tokenizer"]
            if not self.model_name and info.get("model_name"):
                self.model_name = info["model_name"]

    def _spawn(self) -> _Worker:
        actor = self._actor_class.options(max_restarts=0, max_task_retries=0, **self._actor_options).remote(
            self.backend_factory, self.model_name, self._threads
        )
        worker = _Worker(self._next_number, actor)
        self._next_number += 1
        self._workers[worker.number] = worker
        self._pending_starts[actor.start.remote()] = worker
        return worker

    def _lose(self, worker: _Worker, error: BaseException) -> None:
        """Forget a dead (or broken) worker and start a replacement while the budget lasts."""
        self.worker_deaths += 1
        self._workers.pop(worker.number, None)
        try:
            self.ray.kill(worker.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.replacements < self.workers * self.max_attempts:
            self.replacements += 1
            self._spawn()

    def close(self) -> None:
        for worker in list(self._workers.values()):
            try:
                self.ray.kill(worker.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._workers.clear()
        self._pending_starts.clear()
        if self._started_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self._started_ray = False

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the executor ------------------------------------------------------------------------------
    def __call__(self, work: list[PendingItem], writer: ResultsWriter, bar: Any, fields: dict) -> int:
        """Run ``work`` on the workers; the driver appends every record as it arrives."""
        ray = self.ray
        self._ensure_started()
        for _ in range(min(self.workers, len(work)) - len(self._workers)):
            self._spawn()
        queue = deque(_Job(entry) for entry in work)
        idle = [w for w in self._workers.values() if w.started]
        running: dict[Any, tuple[_Worker, _Job]] = {}
        written = 0
        fields_ref = dict(fields)

        def finish(job: _Job, records: list[dict]) -> None:
            nonlocal written
            for record in records:
                writer.append(record)
                written += 1
            if bar is not None:
                bar.update(len(job.entry.settings))
                bar.set_postfix_str(
                    f"{len(self._workers)} workers" + (f", {self.worker_deaths} lost" if self.worker_deaths else ""),
                    refresh=False,
                )

        def fail(job: _Job, worker: _Worker, reason: str) -> None:
            job.attempts += 1
            job.failed_on.add(worker.number)
            job.last_reason = reason
            if job.attempts < self.max_attempts:
                queue.appendleft(job)  # retried next, on another worker when one is free
            else:
                finish(
                    job,
                    failed_records(
                        job.entry,
                        fields_ref,
                        f"{reason} (after {job.attempts} attempts; a rerun retries it)",
                        job.attempts,
                    ),
                )

        while queue or running:
            # hand out work: each item to an idle worker it has not failed on, if the pool has one
            for job in list(queue):
                if not idle:
                    break
                fresh = [w for w in idle if w.number not in job.failed_on]
                if not fresh and any(w.number not in job.failed_on for w in self._workers.values()):
                    continue  # a worker it has not failed on exists: wait for it
                worker = (fresh or idle)[0]
                idle.remove(worker)
                queue.remove(job)
                entry = job.entry
                running[worker.actor.run_item.remote(entry.task, entry.item, entry.settings, fields_ref)] = (
                    worker,
                    job,
                )
            waiting = list(running) + list(self._pending_starts)
            if not waiting:
                raise RayClusterError(
                    f"every Ray worker died and the {self.workers * self.max_attempts} replacements are spent "
                    f"(last failure: {self._last_failure}); finished results are in {writer.path}: rerun to resume"
                )
            ready, _ = ray.wait(waiting, num_returns=1)
            ref = ready[0]
            if ref in self._pending_starts:
                worker = self._pending_starts.pop(ref)
                try:
                    ray.get(ref)
                except self.ray.exceptions.RayError as error:
                    self._last_failure = f"worker could not start: {_short(getattr(error, 'cause', None) or error)}"
                    self._lose(worker, error)
                    continue
                worker.started = True
                idle.append(worker)
                continue
            worker, job = running.pop(ref)
            try:
                records = ray.get(ref)
            except self.ray.exceptions.RayTaskError as error:  # the item raised; the worker lives on
                self.item_errors += 1
                cause = error.cause if isinstance(error.cause, BaseException) else error
                if isinstance(cause, INVALID_INPUT_ERRORS):
                    raise cause from None  # bad input stops the run, as it does in one process
                self._last_failure = _short(cause)
                idle.append(worker)
                fail(job, worker, self._last_failure)
                continue
            except self.ray.exceptions.RayError as error:  # the worker's process (or node) is gone
                self._last_failure = f"worker died ({type(error).__name__})"
                self._lose(worker, error)
                fail(job, worker, self._last_failure)
                continue
            idle.append(worker)
            finish(job, records)
        return written

    _last_failure = "none"


def run_eval_distributed(
    backend_factory: Callable[[str], Backend],
    model_name: str,
    tasks: Sequence[str | Task] | str,
    methods: Sequence[str] | Mapping[str, Sequence[str]],
    budgets: Sequence[float | int] | Mapping[str, Sequence[float | int]] | None,
    limit: int | None,
    data_dir: str | Path | None,
    out_dir: str | Path,
    seed: int = 0,
    progress: bool = True,
    *,
    address: str | None = None,
    workers: int | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    method_validator: MethodValidator | None = None,
    include_full: bool = True,
    suite: str | None = None,
    init_options: Mapping[str, Any] | None = None,
    dtype: str = DEFAULT_DTYPE,
) -> EvalRun:
    """:func:`~kvhive.evaluation.runner.run_eval` with the items spread over Ray actors, each
    holding ``backend_factory(model_name)``.

    ``address``: None starts a local Ray instance (stopped at the end); ``"auto"`` or
    ``"HOST:PORT"`` / ``"ray://HOST:PORT"`` joins an existing cluster (kvhive and the model must be
    installed on its nodes). When this process is already connected to Ray (``ray.init`` done),
    that connection is used. ``workers``: actors to start (default: one per GPU of the cluster,
    else one per CPU). ``max_attempts``: tries per item before its settings are recorded as transient (a rerun retries them).
    """
    with RayPool(backend_factory, model_name, workers, address, max_attempts, init_options) as pool:
        return run_eval(
            pool,
            tasks,
            methods,
            budgets,
            limit,
            data_dir,
            out_dir,
            seed=seed,
            progress=progress,
            method_validator=method_validator,
            model_name=model_name,
            include_full=include_full,
            suite=suite,
            executor=pool,
            dtype=dtype,
        )
