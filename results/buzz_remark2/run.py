"""Issue 26: BUZZ's Remark 2 prefill thinning in the mean form, ``prefill_fit="budget"`` (kvhive's
default: thin until the layer fits C) vs ``"peak"`` (the paper's literal container T + k + w).

WikiText-2 windows (``ppl:prefill_tokens=P``): a prompt of P tokens (BOS included) prefilled in one
forward, then 128 tokens teacher-forced one at a time; Gemma-3-270M, fp32, CPU, one thread.

  C = 100: P = 512; the single pass keeps ceil(482/5) = 97 samples, between C - k - w = 70 and T = 113.
  C =  50: P = 256; ceil(240/5) = 48 samples, between 34 and T = 54.

Four settings per budget (plus the full cache), paired on the same windows: both readings at C;
today's reading at C' whose mean held memory over a window equals the literal reading's at C
(C' = 108 and 51), and the literal reading at C'' whose mean equals today's at C (C'' = 95 and 49);
summary.py checks the match from the recorded sizes. The runner's grid is methods x budgets, so
this script hands run_eval the four settings explicitly (``settings_for`` replaced for the call).
Resumable: rerun to go on; the limit grows in steps of 5 windows, C = 100 and C = 50 in turn.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python results/buzz_remark2/run.py [--limits 5,10,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvhive.evaluation import runner
from kvhive.evaluation.backend import FULL_BUDGET, FULL_METHOD, Setting
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.kvhive_backend import make_backend

HERE = Path(__file__).parent
LITERAL = "buzz:prefill_fit=peak"
RUNS = {
    "c100": ("ppl:num_tokens=63900:window=639:prefill_tokens=512", [("buzz", 100), (LITERAL, 100), ("buzz", 108), (LITERAL, 95)]),
    "c50": ("ppl:num_tokens=38300:window=383:prefill_tokens=256", [("buzz", 50), (LITERAL, 50), ("buzz", 51), (LITERAL, 49)]),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limits", default=",".join(str(n) for n in range(5, 101, 5)))
    args = parser.parse_args()
    backend = make_backend("gemma-3-270m", "float32")
    original = runner.settings_for
    try:
        for limit in (int(x) for x in args.limits.split(",")):
            for name, (task, settings) in RUNS.items():
                explicit = [Setting(FULL_METHOD, FULL_BUDGET)] + [Setting(m, b) for m, b in settings]
                runner.settings_for = lambda methods, budgets, include_full, _s=explicit: list(_s)
                runner.run_eval(
                    backend, [task], sorted({m for m, _ in settings}), sorted({b for _, b in settings}), limit,
                    default_data_dir(), HERE / name, progress=False, model_name="gemma-3-270m",
                )
                print(name, "limit", limit, "done", flush=True)
    finally:
        runner.settings_for = original


if __name__ == "__main__":
    main()
