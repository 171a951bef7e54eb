#!/usr/bin/env bash
# Run the serial tests, then the MPI tests at each rank count in $RANKS, with the MPI of $VENV.
# Each MPI run is `mpirun -n N python -m mpi4py -m pytest --with-mpi` under `timeout`, so a
# failing rank aborts the job instead of hanging it. The launcher is the venv's own (Open MPI's
# or MPICH's Hydra `mpirun`); a rank's number comes from OMPI_COMM_WORLD_RANK (Open MPI) or
# PMI_RANK (MPICH). Rank 0's pytest output is printed; every rank's full log is kept in
# .test-logs/VENV/nN/rankR.log and printed if that run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
RANKS=${RANKS-1 2 3 4 5 8}
SERIAL=${SERIAL:-1}
SERIAL_TESTS=${SERIAL_TESTS:-tests}   # what the serial run collects
SERIAL_ALONE=${SERIAL_ALONE:-}        # of those, files run one test at a time after the others
SERIAL_WORKERS=${SERIAL_WORKERS:-2}   # pytest-xdist workers for the rest (1: no xdist)
MPI_TESTS=${MPI_TESTS:-tests}         # what each MPI run collects
MPI_SELECT=${MPI_SELECT:-}            # a pytest -k expression for the MPI runs (empty: all)
MPI_TIMEOUT=${MPI_TIMEOUT:-600}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1
status=0
start=$(date +%s)
# MPICH's version string ends in NUL bytes: dropped before bash sees them (it warns otherwise)
echo "=== MPI: $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())' | tr -d '\0')"
passed=0
failed=0
summary_of() {  # pytest's summary line in a log (MPI libraries may print after it at exit)
    grep -aE "^[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" "$1" | tail -n 1
}
count() {  # add the counts of a pytest summary line to the totals
    local line=$1 n
    n=$(grep -oE "[0-9]+ passed" <<<"$line" | grep -oE "[0-9]+"); passed=$((passed + ${n:-0}))
    for n in $(grep -oE "[0-9]+ (failed|errors?)" <<<"$line" | grep -oE "[0-9]+"); do
        failed=$((failed + n))
    done
}

serial_run() {  # a pytest run of serial tests: its label, then pytest's arguments
    local label=$1 t0 rc
    shift
    echo "=== serial tests$label"
    t0=$(date +%s)
    timeout "$MPI_TIMEOUT" "$PY" -m pytest -q --color=no -m "not mpi and not slow" "$@" \
        | tee .test-logs-serial.txt
    rc=${PIPESTATUS[0]}
    count "$(summary_of .test-logs-serial.txt)"
    echo "=== serial tests$label: $(summary_of .test-logs-serial.txt) ($(( $(date +%s) - t0 )) s)"
    rm -f .test-logs-serial.txt
    [ $rc -ne 0 ] && { echo "serial tests$label failed (exit $rc)"; status=1; }
}

if [ "$SERIAL" = 1 ]; then
    if [ -n "$SERIAL_ALONE" ] && [ "$SERIAL_WORKERS" -gt 1 ] \
            && "$PY" -c 'import xdist' 2>/dev/null; then
        # the pure-Python tests on $SERIAL_WORKERS workers (pytest-xdist); those that launch
        # MPI jobs or time things ($SERIAL_ALONE) after them, one at a time
        ignored=()
        for f in $SERIAL_ALONE; do ignored+=("--ignore=$f"); done
        serial_run " (on $SERIAL_WORKERS workers)" -n "$SERIAL_WORKERS" -p no:cacheprovider \
            "${ignored[@]}" $SERIAL_TESTS
        serial_run " (one at a time)" $SERIAL_ALONE
    else
        serial_run "" $SERIAL_TESTS
    fi
fi

if [ "$MPI_TESTS" = tests ]; then
    # only the files that hold MPI tests: every rank collects what it is given, and at -n 8 on
    # 2 cores collecting the whole directory cost 21 s against 15 s for these
    MPI_TESTS=$(grep -l "mark\.mpi" tests/test_*.py | tr '\n' ' ')
fi

for n in $RANKS; do
    echo "=== MPI tests, -n $n"
    logs=.test-logs/$(basename "$VENV")/n$n
    rm -rf "$logs" && mkdir -p "$logs"
    t0=$(date +%s)
    timeout "$MPI_TIMEOUT" "$VENV/bin/mpirun" -n "$n" bash -c '
        exec > "$0/rank${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}.log" 2>&1
        exec "$1" -m mpi4py -m pytest -q --color=no -p no:cacheprovider --with-mpi \
            -m "mpi and not slow" ${3:+-k "$3"} $2' "$logs" "$PY" "$MPI_TESTS" "$MPI_SELECT"
    rc=$?
    cat "$logs/rank0.log"
    if [ $rc -ne 0 ]; then
        echo "MPI tests at -n $n failed (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
        for f in "$logs"/rank*.log; do
            [ "$f" = "$logs/rank0.log" ] && continue
            if grep -qE "FAILED|Error|Traceback" "$f"; then echo "--- $f"; tail -n 60 "$f"; fi
        done
        status=1
    fi
    summary=$(summary_of "$logs/rank0.log")
    count "$summary"
    [ $rc -ne 0 ] && ! grep -qE "failed|error" <<<"$summary" && failed=$((failed + 1))
    echo "=== -n $n: $summary ($(( $(date +%s) - t0 )) s)"
done
echo "=== all test runs finished in $(( $(date +%s) - start )) s, status $status"
echo "total: $passed passed, $failed failed"
exit $status
