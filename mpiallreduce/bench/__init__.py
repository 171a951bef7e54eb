"""OSU-style allreduce benchmark: latency, bus bandwidth and a check against MPI's own Allreduce.

    mpirun -n 4 python -m mpi4py -m mpiallreduce.bench [--sizes 8:16M] [--algorithms all] ...

For every message size (powers of two) and every algorithm, on every rank: build a plan (outside
any timing), run it ``warmup`` times untimed, barrier, time ``iterations`` runs with
``MPI.Wtime`` and keep this rank's mean. The row shows the average, minimum and maximum of the
per-rank means across ranks (as OSU's osu_allreduce does), algbw = size / avg and
busbw = algbw * 2(p-1)/p (as nccl-tests defines it), the ratio native avg / this avg (above 1:
faster than MPI's own Allreduce) and the validation verdict: after timing, the plan runs once
more on fresh input and every rank compares its result with ``comm.Allreduce`` of the same input.
The inputs are small integers (in the chosen dtype), so every reduction order gives the exact
same result and the comparison is bit for bit.

Output goes to rank 0's stdout. Exit status: 0, 1 if any validation failed, 2 for bad arguments,
the same on every rank.

Modules: ``options`` (the command line, its defaults and checks, the cases it selects),
``measure`` (one size's input, reference, timed and validated runs), ``report`` (header, rows,
summary and advice, JSON, CSV, plot), ``cli`` (the sweep and :func:`main`).
"""

from ..ops import OP_NAMES
from ..sizes import UsageError, human, parse_size, parse_sizes
from ..topology import RANKS_PER_NODE_ENV
from .cli import main, run
from .measure import Case, Row, make_input
from .options import (
    APIS,
    BUDGET_BYTES,
    DEFAULT_SIZES,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    GLOO,
    ITERATION_RULE,
    MAX_ITERATIONS,
    MIN_ITERATIONS,
    MPI_CALL,
    MPI_INIT,
    RECOMMEND_ROUNDS,
    HelpShown,
    Options,
    build_parser,
    check_outputs,
    default_iterations,
    op_of,
    parse_algorithms,
    parse_apis,
    parse_args,
)
from .report import (
    format_row,
    header_lines,
    metadata,
    plot,
    recommendations,
    summary_lines,
    write_csv,
    write_json,
)

__all__ = [
    "APIS", "BUDGET_BYTES", "DEFAULT_SIZES", "EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "GLOO", "ITERATION_RULE",
    "MAX_ITERATIONS", "MIN_ITERATIONS", "MPI_CALL", "MPI_INIT", "OP_NAMES", "RANKS_PER_NODE_ENV",
    "RECOMMEND_ROUNDS",
    "Case", "HelpShown", "Options", "Row", "UsageError", "build_parser", "check_outputs",
    "default_iterations", "format_row", "header_lines", "human", "main", "make_input", "metadata",
    "op_of", "parse_algorithms", "parse_apis", "parse_args", "parse_size", "parse_sizes", "plot",
    "recommendations", "run", "summary_lines", "write_csv", "write_json",
]
