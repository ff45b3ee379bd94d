"""Evaluation harness: tasks, metrics, resumable runner, report and the paper-claims suite.

Model-independent: everything talks to a :class:`~kvhive.evaluation.backend.Backend`
(``kvhive_backend.py`` wraps ``kvhive.api``).

    from kvhive.evaluation import run_eval, write_report
    run_eval(backend, ["needle", "mdqa"], ["snapkv", "h2o"], [0.2, 128], limit=10,
             data_dir="../shared/data", out_dir="runs/x", seed=0)
    write_report("runs/x")
"""

from .backend import Backend, Setting, parse_budgets, validate_budgets
from .claims import CLAIMS, Claim, claims_grid, evaluate_claims
from .report import write_report
from .results import ResultsSummary, read_results
from .runner import EvalRun, run_eval
from .tasks import TASKS, Item, Task, available_tasks, get_task, parse_task_spec

__all__ = [
    "Backend",
    "Setting",
    "parse_budgets",
    "validate_budgets",
    "run_eval",
    "EvalRun",
    "write_report",
    "read_results",
    "ResultsSummary",
    "CLAIMS",
    "Claim",
    "claims_grid",
    "evaluate_claims",
    "TASKS",
    "Item",
    "Task",
    "available_tasks",
    "get_task",
    "parse_task_spec",
]
