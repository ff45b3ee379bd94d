"""``kvhive eval --ray`` under misuse (issue 27): an unreachable cluster fails fast with one line,
a local instance listens on the loopback only, and a run whose workers all die ends with one
line, not a traceback.

Each test starts (or fails to reach) its own Ray instance, so this module never shares one with
tests/evaluation/test_ray_runner.py.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest
import ray

from kvhive.evaluation.cli import main as evaluation_main
from kvhive.evaluation.distributed import RayClusterError, RayPool, probe_address
from kvhive.evaluation.kvhive_backend import make_backend

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers get the factories by value

MODEL = "tiny-llama-gqa"
RECALL = "synthetic_recall:num_pairs=6"


def _never_called(model_name):
    raise AssertionError("the model was loaded although the cluster cannot be reached")


def _eval_argv(tmp_path, *ray_arguments):
    return ["eval", "--model", MODEL, "--tasks", RECALL, "--methods", "h2o", "--budgets", "0.5", "--limit", "1",
            "--out", str(tmp_path / "out"), "--no-progress", "--no-report", *ray_arguments]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_ray_left_running():
    assert not ray.is_initialized()
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_an_unreachable_cluster_fails_fast_with_one_line(tmp_path):
    # Before issue 27, `kvhive eval --ray 127.0.0.1:1` hung for minutes inside ray.init.
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        evaluation_main(_eval_argv(tmp_path, "--ray", "127.0.0.1:1"), backend_factory=_never_called)
    assert time.monotonic() - start < 15
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith("kvhive eval: --ray: cannot reach the Ray cluster at 127.0.0.1:1")
    assert "ray start --head" in message and not ray.is_initialized()
    with pytest.raises(RayClusterError, match="ray://127.0.0.1:1"):
        probe_address("ray://127.0.0.1:1")
    probe_address("auto")  # left to Ray, which answers it at once


def test_a_local_instance_listens_on_the_loopback_only():
    with RayPool(make_backend, MODEL, workers=1) as pool:
        assert pool.tokenizer is not None  # the instance and one worker are up
        ours = {p.pid for p in [psutil.Process(), *psutil.Process().children(recursive=True)]}
        listening = {
            (psutil.Process(c.pid).name(), c.laddr.ip)
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in ours
        }
        assert len(listening) >= 3  # GCS, raylet, worker, ...: Ray's processes do listen
        loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
        assert {ip for _, ip in listening} <= loopback, sorted(listening)


def _dying_factory(model_name):
    os._exit(1)  # the worker's process dies while loading the model, every time


def test_every_worker_dead_ends_the_run_with_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        evaluation_main(_eval_argv(tmp_path, "--ray", "--workers", "1"), backend_factory=_dying_factory)
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith("kvhive eval: --ray: no Ray worker could start")
    assert not ray.is_initialized()
