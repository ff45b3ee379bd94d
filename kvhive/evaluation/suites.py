"""Named evaluation suites: ``quick`` (minutes on 2 CPU cores with a 270M model) and ``claims``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .claims import claims_grid


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: tuple[str, ...]  # task specs ("needle:lengths=512")
    methods: Sequence[str] | Mapping[str, Sequence[str]]
    budgets: Sequence[float | int] | Mapping[str, Sequence[float | int]] | None
    limit: int | None
    description: str = field(default="")
    dtype: str | None = None  # the model's dtype for this suite (None: the CLI default)
    expected_duration: str = field(default="")  # said when the run starts (what the committed runs took)


QUICK = Suite(
    name="quick",
    tasks=(
        "synthetic_recall",
        "needle:lengths=512:depths=0+50+100:max_new_tokens=12",
        "mdqa:max_new_tokens=16",
        "xsum:max_new_tokens=32",
        "piqa",
    ),
    methods=("streamingllm", "h2o", "snapkv"),
    # 5-shot piqa contexts are ~130 tokens: a 0.2 ratio would fall below SnapKV's 32-token window.
    budgets={
        "synthetic_recall": (0.2, 0.5),
        "needle": (0.2, 0.5),
        "mdqa": (0.2, 0.5),
        "xsum": (0.2, 0.5),
        "piqa": (0.5,),
    },
    limit=4,
    description="5 tasks x 3 methods x 2 ratio budgets (+ full cache), 4 items each",
    expected_duration="about a minute on 2 CPU cores for gemma-3-270m, once the model is converted",
)


# The claims run's task parameters where the task defaults would not decide: streaming
# perplexity over 40 windows of 256 tokens (BUZZ Table 3's caches of 50/100 tokens), needles and
# multi-document QA at 2k and 4k tokens (where a 0.5B model's full cache retrieves; 1k is within
# most budgets' reach).
CLAIMS_TASK_SPECS = {
    # 40 windows of 256 tokens (the suite's 40 items): on Qwen2.5-0.5B BUZZ - H2O at 50 tokens was
    # +13.4 +- 8.4 perplexity (paired s.e.) on 8 windows and +15.8 +- 9.8 on 32: the per-window
    # spread grows with more text (heavy tails), so the report states the windows each gap needs.
    "ppl": "ppl:num_tokens=10240:window=256",
    "needle": "needle:lengths=2000+4000",
    "needle_multikey": "needle_multikey:lengths=2000+4000",
    # 20 and 33 documents: about 2.4k and 4k tokens on Qwen2.5-0.5B; each question at both lengths,
    # gold first, in the middle and last.
    "mdqa": "mdqa:num_documents=20+33:gold_positions=0+middle+-1",
}


def claims_suite(limit: int | None = 40) -> Suite:
    # 40 items a task and bf16 (how users serve): the committed runs (results/claims_qwen,
    # results/claims_gemma) are exactly `kvhive eval --suite claims --model M`.
    tasks, methods, budgets = claims_grid()
    return Suite(
        name="claims",
        tasks=tuple(CLAIMS_TASK_SPECS.get(task, task) for task in tasks),
        methods=methods,
        budgets=budgets,
        limit=limit,
        description="every method/budget the paper claims need (kvhive/evaluation/claims.py)",
        dtype="bfloat16",
        expected_duration=(
            "hours on a CPU: about 2 h of one core for gemma-3-270m and 4 h for qwen2.5-0.5b at 40 items a task "
            "(results/claims_gemma, results/claims_qwen); the progress bar estimates the rest as it goes, and a "
            "stopped run resumes where it stopped"
        ),
    )


SUITES = {"quick": lambda: QUICK, "claims": claims_suite}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    return SUITES[name]()
