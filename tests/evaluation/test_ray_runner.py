"""The evaluation grid on a local Ray cluster (kvhive.evaluation.distributed), on a tiny model.

One Ray instance (2 CPUs) serves the whole module; the driver-kill test joins it from a
subprocess by its address, as ``kvhive eval --ray ADDRESS`` joins a cluster.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from kvhive.cli import main as kvhive_main
from kvhive.evaluation import read_results, run_eval
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.distributed import INSTALL_HINT, RayPool, run_eval_distributed
from kvhive.evaluation.kvhive_backend import KVHiveBackend, make_backend
from kvhive.evaluation.results import result_key
from kvhive.evaluation.tasks import get_task
from kvhive.models import load_model

# The backends below live in this module: Ray workers receive them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODEL = "tiny-llama-gqa"
DATA_DIR = default_data_dir()  # $KVHIVE_DATA_DIR, else <repo>/../shared/data
RECALL = "synthetic_recall:num_pairs=6"
GRID = dict(
    tasks=[RECALL, "ppl:num_tokens=48:window=24", "piqa"],
    methods=["h2o", "streamingllm"],
    budgets={"synthetic_recall": [0.5, 16], "ppl": [16], "piqa": [0.5]},
    limit=3,
)
# Fields that depend on when and how fast an item ran, not on what it computed.
TIMING_FIELDS = {"wall_s", "time"}


@pytest.fixture(scope="module")
def ray_address():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of GRID."""
    out = tmp_path_factory.mktemp("reference")
    run_eval(
        make_backend(MODEL),
        GRID["tasks"],
        GRID["methods"],
        GRID["budgets"],
        GRID["limit"],
        DATA_DIR,
        out,
        progress=False,
        model_name=MODEL,
    )
    return {result_key(r): r for r in read_results(out)}


def _same_record(mine: dict, theirs: dict) -> None:
    assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
    for name in set(mine) - TIMING_FIELDS:
        if name == "output" and mine["kind"] != "generate" and mine[name] is not None:
            # log-likelihoods: the same computation, in another process
            assert all(
                math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-5) for a, b in zip(mine[name], theirs[name], strict=True)
            ), mine["setting"]
        elif name == "metrics" and mine["kind"] == "perplexity":
            assert mine[name].keys() == theirs[name].keys()
            for metric, value in mine[name].items():
                assert math.isclose(value, theirs[name][metric], rel_tol=1e-6), (mine["setting"], metric)
        else:
            assert mine[name] == theirs[name], (mine["setting"], name, mine[name], theirs[name])


def _recall_prompt(index: int) -> str:
    _, tokenizer = load_model(MODEL)
    task = get_task("synthetic_recall", num_pairs=6)
    return task.load(DATA_DIR, GRID["limit"], 0, tokenizer)[index].prompt


class TroubledBackend(KVHiveBackend):
    """The kvhive backend, except on one prompt: ``"raise"`` raises RuntimeError every time,
    ``"die"`` kills its own process every time, ``"die-once"`` kills its process the first time
    any worker meets it (a marker file records that it happened)."""

    def __init__(self, model, tokenizer, trigger: str, mode: str, marker: str) -> None:
        super().__init__(model, tokenizer, model_name=MODEL)
        self.trigger, self.mode, self.marker = trigger, mode, marker

    def generate(self, prompt, max_new_tokens, settings):
        if prompt == self.trigger:
            with open(self.marker, "a") as log:  # one line per attempt: pid
                log.write(f"{os.getpid()}\n")
            if self.mode == "raise":
                raise RuntimeError("boom on the trigger item")
            if self.mode == "die" or (self.mode == "die-once" and len(Path(self.marker).read_text().split()) == 1):
                os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompt, max_new_tokens, settings)


class TroubledFactory:
    def __init__(self, trigger: str, mode: str, marker: Path) -> None:
        self.trigger, self.mode, self.marker = trigger, mode, str(marker)

    def __call__(self, model_name: str) -> TroubledBackend:
        model, tokenizer = load_model(model_name)
        return TroubledBackend(model, tokenizer, self.trigger, self.mode, self.marker)


def _run_pool(factory, out: Path, workers: int = 2, max_attempts: int = 3, **grid):
    grid = {**GRID, "tasks": [RECALL], **grid}  # the failure tests need one task only
    with RayPool(factory, MODEL, workers=workers, max_attempts=max_attempts) as pool:
        run = run_eval(
            pool,
            grid["tasks"],
            grid["methods"],
            grid["budgets"],
            grid["limit"],
            DATA_DIR,
            out,
            progress=False,
            model_name=MODEL,
            executor=pool,
        )
        return run, pool.worker_deaths


def test_two_workers_give_the_single_process_results_even_when_one_dies_mid_item(ray_address, reference, tmp_path):
    # One worker is SIGKILLed in the middle of an item (the first time any worker meets it): the
    # item is retried in another process, and the grid still equals the single-process run.
    marker = tmp_path / "attempts"
    factory = TroubledFactory(_recall_prompt(1), "die-once", marker)
    with RayPool(factory, MODEL, workers=2) as pool:
        run = run_eval(
            pool,
            GRID["tasks"],
            GRID["methods"],
            GRID["budgets"],
            GRID["limit"],
            DATA_DIR,
            tmp_path / "out",
            progress=False,
            model_name=MODEL,
            executor=pool,
        )
        assert pool.worker_deaths == 1
    attempts = marker.read_text().split()
    assert len(attempts) == 2 and attempts[0] != attempts[1]  # died in one process, done in another
    assert run.written == run.total == len(reference)
    records = read_results(tmp_path / "out")
    assert len(records) == len((tmp_path / "out" / "results.jsonl").read_text().splitlines())  # no duplicate lines
    assert {result_key(r) for r in records} == set(reference)
    for record in records:
        _same_record(record, reference[result_key(record)])
    # a rerun finds everything done and writes nothing
    again = run_eval_distributed(
        make_backend,
        MODEL,
        GRID["tasks"],
        GRID["methods"],
        GRID["budgets"],
        GRID["limit"],
        DATA_DIR,
        tmp_path / "out",
        progress=False,
        workers=2,
    )
    assert (again.written, again.skipped) == (0, run.total)


@pytest.mark.parametrize("mode, reason", [("raise", "RuntimeError: boom on the trigger item"), ("die", "worker died")])
def test_an_item_that_always_fails_is_recorded_as_transient_and_the_grid_completes(
    ray_address, reference, tmp_path, mode, reason
):
    marker = tmp_path / "attempts"
    trigger = _recall_prompt(0)
    run, deaths = _run_pool(TroubledFactory(trigger, mode, marker), tmp_path / "out", max_attempts=2)
    attempts = marker.read_text().split()
    assert len(attempts) == len(set(attempts)) == 2  # bounded: max_attempts tries, each in another process
    assert deaths == (2 if mode == "die" else 0)
    records = read_results(tmp_path / "out")
    assert run.written == run.total == len(records) == 3 * 5
    failed = [r for r in records if r["status"] == "transient"]
    assert {r["item_id"] for r in failed} == {"item0"} and {r["task"] for r in failed} == {"synthetic_recall"}
    assert len(failed) == 5  # full + 2 methods x 2 budgets
    for record in failed:
        assert reason in record["reason"] and record["attempts"] == 2 and record["metrics"] == {}
    for record in records:
        if record["status"] != "transient":
            _same_record(record, reference[result_key(record)])


def test_invalid_input_stops_the_run_as_in_one_process(ray_address, tmp_path):
    class Refusing(TroubledFactory):
        def __call__(self, model_name):
            backend = super().__call__(model_name)
            backend.generate = lambda *args: (_ for _ in ()).throw(ValueError("budget: refused"))
            return backend

    with pytest.raises(ValueError, match="budget: refused"):
        _run_pool(Refusing("", "raise", tmp_path / "m"), tmp_path / "out", tasks=[RECALL], limit=1)


DRIVER = textwrap.dedent(
    """
    import sys, time
    from kvhive.evaluation.distributed import run_eval_distributed
    from kvhive.evaluation.kvhive_backend import make_backend

    def slow_backend(name):  # slow enough for the test to kill the driver mid-grid
        backend = make_backend(name)
        generate = backend.generate
        def slow(*args):
            time.sleep(0.3)
            return generate(*args)
        backend.generate = slow
        return backend

    run_eval_distributed(slow_backend, "tiny-llama-gqa", ["synthetic_recall:num_pairs=6"], ["h2o", "streamingllm"],
                         [0.5, 16], 8, sys.argv[2], sys.argv[1], progress=False, address=sys.argv[3], workers=2)
    """
)


def test_a_killed_driver_loses_nothing_and_duplicates_nothing_on_rerun(ray_address, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out"
    command = [sys.executable, str(script), str(out), str(DATA_DIR), ray_address]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results = out / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and driver.poll() is None:
        if results.exists() and results.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.02)
    assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    before = read_results(out)
    assert 5 <= len(before) < 8 * 5  # killed mid-grid

    # the rerun (here, on the same cluster) resumes
    rerun = run_eval_distributed(
        make_backend, MODEL, [RECALL], ["h2o", "streamingllm"], [0.5, 16], 8, DATA_DIR, out, progress=False, workers=2
    )
    assert rerun.skipped == len(before) and rerun.written == 8 * 5 - len(before)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    keys = [result_key(record) for record in lines]
    assert len(keys) == len(set(keys)) == 8 * 5  # every result once
    assert [result_key(r) for r in before] == keys[: len(before)]  # what was written survived, in place


def test_without_ray_the_flag_fails_with_one_line_saying_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        kvhive_main(
            [
                "eval",
                "--model",
                MODEL,
                "--tasks",
                RECALL,
                "--methods",
                "h2o",
                "--budgets",
                "0.5",
                "--limit",
                "1",
                "--out",
                str(tmp_path / "x"),
                "--no-progress",
                "--ray",
            ]
        )
    message = str(exit_info.value.code)
    assert "\n" not in message and INSTALL_HINT in message and "pip install 'kvhive[ray]'" in message
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "extra, expected",
    [(["--workers", "2"], "--workers needs --ray"), (["--ray", "--workers", "0"], "--workers must be an integer >= 1")],
)
def test_worker_options_are_checked(tmp_path, extra, expected):
    with pytest.raises(SystemExit, match=expected):
        kvhive_main(
            ["eval", "--model", MODEL, "--tasks", RECALL, "--methods", "h2o", "--out", str(tmp_path / "x"), *extra]
        )


def test_more_workers_than_the_cluster_can_place_is_refused(ray_address, tmp_path):
    # Actors asking for CPUs the cluster does not have would wait forever: refuse up front.
    with pytest.raises(ValueError, match=r"workers: 3 workers need 3 CPUs but the Ray cluster has 2"):
        _run_pool(make_backend, tmp_path / "out", workers=3)
    assert not (tmp_path / "out" / "results.jsonl").exists()
