#!/usr/bin/env bash
# Mutation testing of kvhive/methods/ with mutmut (issue 10), scoped to the method tests
# ([tool.mutmut] in pyproject.toml: the tests that exercise methods on tiny tensors and tiny
# models, without the embedded-model tests). Not run by CI: ~6,500 mutants; one run on the shared
# 2-core machine took about the time stated in results/mutation/summary.md. mutmut resumes:
# rerunning continues where it stopped. Results: `mutmut results`, `mutmut show NAME`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pip install -q "mutmut==3.8.1"
# mutants/ is not committed (mutated copies of the source); the verdicts are: mutmut keeps a
# function's verdicts while its source hash is unchanged, so restoring the saved .meta files lets a
# fresh checkout resume where the last run stopped instead of starting over (mutmut recollects its
# test-timing stats, a few minutes, and re-tests the functions whose source changed since).
STATE=results/mutation/state
if [ ! -d mutants ] && [ -d "$STATE" ]; then
    mkdir -p mutants/kvhive/methods
    cp "$STATE"/methods/*.meta mutants/kvhive/methods/
fi
save_state() {
    mkdir -p "$STATE/methods"
    cp mutants/kvhive/methods/*.meta "$STATE/methods/" 2>/dev/null || true
}
# mutmut derives each mutant's CPU limit from test durations measured in its stats mode, which
# records every call and runs ~30x slower than a plain run here: a mutant that loops (e.g. a
# rejection sampler that never accepts) then holds a worker for over ten minutes. The watchdog sends
# the signal mutmut's own limit sends (SIGXCPU: recorded as "timeout") once a mutant has used
# MUTMUT_CPU_LIMIT CPU seconds; unmutated, the whole test file of any one method takes at most ~12.
watchdog() {
    while sleep 10; do
        for pid in $(pgrep -f "^mutmut: kvhive" || true); do
            used=$(ps -o cputimes= -p "$pid" 2>/dev/null | tr -d ' ' || true)
            if [ -n "$used" ] && [ "$used" -gt "${MUTMUT_CPU_LIMIT:-60}" ]; then
                kill -XCPU "$pid" 2>/dev/null || true
            fi
        done
    done
}
watchdog &
WATCHDOG=$!
trap 'kill $WATCHDOG 2>/dev/null; save_state' EXIT
OMP_NUM_THREADS=1 .venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-1}" "$@"
.venv/bin/python scripts/mutation_summary.py > results/mutation/summary.md
