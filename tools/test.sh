#!/usr/bin/env bash
# The project's test command: the CPU test suite (GPU tests deselected), spread over this machine's
# cores by pytest-xdist, with progress and the 15 slowest tests at the end.
# README and .ci/run both call this file, so the command lives in one place.
#   tools/test.sh                        # whole suite
#   tools/test.sh tests/test_x.py -k y   # extra arguments go to pytest (-n 0: one process)
# It fails when nothing ran: no test collected (pytest exit 5) or no test passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

parallel=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then
    # worksteal: a worker that runs out of tests takes some of the other's (a few tests run a minute)
    parallel=(-n auto --dist worksteal)
else
    echo "tools/test.sh: pytest-xdist is not installed (pip install -e '.[test]'): running in one process"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$PYTHON" -m pytest -m "not gpu" "${parallel[@]}" -q --durations=15 -o console_output_style=count "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 5 ]; then
    echo "tools/test.sh: FAILED: no test ran (pytest exit 5: nothing collected)"
    exit 5
fi
# the summary line, e.g. "== 12 passed, 3 skipped in 4.20s ==": at least one test must pass
if [ "$rc" -eq 0 ] && ! tail -n 3 "$log" | grep -Eq '(^|[^0-9])[1-9][0-9]* passed'; then
    echo "tools/test.sh: FAILED: no test passed (all skipped or deselected)"
    exit 1
fi
exit "$rc"
