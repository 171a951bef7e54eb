"""Distributed conjugate gradient on a 2-D Poisson problem, its reductions through mar.Comm.

    mpirun -n 4 python -m mpi4py examples/conjugate_gradient.py [--grid 48] [--algorithm ring]
        [--reproducible]

The n x n interior grid of -Δu = f (5-point stencil, zero Dirichlet boundary) is split by rows
over the ranks (``partition.block``); the halo rows travel with plain mpi4py ``Sendrecv`` and
the dot products go through ``comm.Allreduce`` on a ``mar.Comm``. The solve runs twice: through
``mar.Comm(MPI.COMM_WORLD, algorithm)`` and through plain ``MPI.COMM_WORLD``. Rank 0 checks the
solution against a serial dense NumPy solve and the iteration count against the plain run's,
prints the time per iteration of each, and the program exits 1 on any mismatch.

``--reproducible`` solves a third time with the dot products through ``mar.dot`` (exact sums,
one rounding: the same bits for any number of ranks and any split of the rows) and prints the
residual history ``r.r`` as hex, which is then bitwise the same at every rank count (``-n 1``,
``-n 2``, ``-n 3``, ...): the stencil and the vector updates are elementwise, so only the
reductions could differ. Without the flag the history of the plain run may differ in its last
bits from one rank count to another.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.partition import block, block_counts


def load(n: int, rows: tuple[int, int]) -> np.ndarray:
    """The right-hand side h²·f on grid rows ``[start, stop)``: a smooth, asymmetric load."""
    h = 1.0 / (n + 1)
    y = h * np.arange(rows[0] + 1, rows[1] + 1)[:, None]
    x = h * np.arange(1, n + 1)[None, :]
    return h * h * (1.0 + x + 2.0 * y * y) * np.sin(np.pi * x)


def laplacian(comm, u: np.ndarray, ghost: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = A u`` for this rank's rows: exchange one halo row with each neighbour, then the stencil."""
    rank, size = comm.Get_rank(), comm.Get_size()
    above = rank - 1 if rank > 0 else MPI.PROC_NULL
    below = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    ghost[1:-1] = u
    comm.Sendrecv(ghost[1], dest=above, recvbuf=ghost[-1], source=below)
    comm.Sendrecv(ghost[-2], dest=below, recvbuf=ghost[0], source=above)
    np.multiply(u, 4.0, out=out)
    out -= ghost[:-2]
    out -= ghost[2:]
    out[:, 1:] -= u[:, :-1]
    out[:, :-1] -= u[:, 1:]
    return out


def dot(comm, a: np.ndarray, b: np.ndarray) -> float:
    """The global dot product: a local one, then ``comm.Allreduce`` (mar.Comm's or MPI's)."""
    local = np.array([np.vdot(a, b)])
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
    return float(local[0])


def reproducible_dot(comm, a: np.ndarray, b: np.ndarray) -> float:
    """The global dot product through ``mar.dot``: the same bits for any split of the rows."""
    return float(mar.dot(a, b, comm=comm))


def solve(comm, n: int, tol: float = 1e-10, maxiter: int = 10_000, history: list | None = None,
          reproducible: bool = False) -> tuple[np.ndarray, int, float]:
    """Run CG on this rank's rows; return (its rows of u, iterations, time in seconds).

    ``history``, if given, receives ``r.r`` before the first and after every iteration;
    ``reproducible`` takes the dot products through :func:`reproducible_dot`.
    """
    product = reproducible_dot if reproducible else dot
    rows = block(n, comm.Get_size(), comm.Get_rank())
    b = load(n, rows)
    u = np.zeros_like(b)
    r = b.copy()
    p = r.copy()
    Ap = np.empty_like(b)
    ghost = np.zeros((b.shape[0] + 2, n))
    comm.Barrier()
    start = time.perf_counter()
    rr = product(comm, r, r)
    stop_at = tol * tol * product(comm, b, b)
    if history is not None:
        history.append(rr)
    iterations = 0
    while iterations < maxiter and rr > stop_at:
        laplacian(comm, p, ghost, Ap)
        alpha = rr / product(comm, p, Ap)
        u += alpha * p
        r -= alpha * Ap
        rr, rr_old = product(comm, r, r), rr
        if history is not None:
            history.append(rr)
        p *= rr / rr_old
        p += r
        iterations += 1
    return u, iterations, time.perf_counter() - start


def serial_solution(n: int) -> np.ndarray:
    """The exact discrete solution by a dense NumPy solve (no SciPy): A = T⊗I + I⊗T."""
    tridiagonal = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    a = np.kron(tridiagonal, np.eye(n)) + np.kron(np.eye(n), tridiagonal)
    return np.linalg.solve(a, load(n, (0, n)).ravel()).reshape(n, n)


def best_of(comm, n: int, repeat: int, reproducible: bool = False
            ) -> tuple[np.ndarray, int, float]:
    """Solve ``repeat`` times; keep the solution, the iteration count and the fastest time."""
    runs = [solve(comm, n, reproducible=reproducible) for _ in range(repeat)]
    u, iterations, _ = runs[0]
    if any(k != iterations for _, k, _ in runs):
        raise RuntimeError("repeated solves took different numbers of iterations")
    return u, iterations, min(seconds for *_, seconds in runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=48, help="interior points per side (n)")
    parser.add_argument("--algorithm", default="auto", choices=mar.ALGORITHMS)
    parser.add_argument("--repeat", type=int, default=3, help="solves per communicator (best time)")
    parser.add_argument("--reproducible", action="store_true",
                        help="also solve with mar.dot and print the residual history as hex")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    if args.grid < world.size:
        parser.error(f"--grid {args.grid} gives some of the {world.size} ranks no rows")

    comm = mar.Comm(world, algorithm=args.algorithm)
    u, iterations, seconds = best_of(comm, args.grid, args.repeat)
    _, plain_iterations, plain_seconds = best_of(world, args.grid, args.repeat)
    if args.reproducible:
        history: list[float] = []
        solve(world, args.grid, history=history, reproducible=True)
        _, exact_iterations, exact_seconds = best_of(world, args.grid, args.repeat,
                                                     reproducible=True)

    rows = world.gather(u, root=0)
    ok = True
    if world.rank == 0:
        n = args.grid
        exact = serial_solution(n)
        error = np.abs(np.vstack(rows) - exact).max() / np.abs(exact).max()
        ok = error < 1e-8 and iterations == plain_iterations
        split = "/".join(map(str, block_counts(n, world.size)))
        print(f"CG, 2-D Poisson {n}x{n} ({n * n} unknowns), {world.size} ranks, rows {split}")
        print(f"mar.Comm(algorithm={args.algorithm!r}): {iterations} iterations, "
              f"max error vs serial solve {error:.1e}")
        print(f"plain MPI.COMM_WORLD:  {plain_iterations} iterations")
        print(f"time per iteration: mar.Comm {1e6 * seconds / iterations:.1f} us, "
              f"plain {1e6 * plain_seconds / plain_iterations:.1f} us "
              f"(2 allreduces of 8 B and 2 halo exchanges each; best of {args.repeat})")
        if args.reproducible:
            print(f"time per iteration with mar.dot (reproducible): "
                  f"{1e6 * exact_seconds / exact_iterations:.1f} us, {exact_iterations} iterations")
            print("residual history r.r (hex, the same bits at any number of ranks):")
            for index, value in enumerate(history):
                print(f"  {index:4d} {value.hex()}")
        print("ok" if ok else "MISMATCH: error above 1e-8 or iteration counts differ")
    return 0 if world.bcast(ok, root=0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
