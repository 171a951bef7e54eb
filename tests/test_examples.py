"""The examples are importable and give the same answer as MPI's own Allreduce."""

import numpy as np
import pytest
from conftest import load_file
from mpi4py import MPI

import mpiallreduce as mar


def load(name):
    return load_file(f"examples/{name}.py", name)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "native", "auto"])
def test_monte_carlo_pi_matches_native_tally(algorithm):
    module = load("monte_carlo_pi")
    comm = MPI.COMM_WORLD
    pi, total = module.estimate_pi(20_000, comm, algorithm, seed=7)
    rng = np.random.default_rng([7, comm.rank])
    xy = rng.random((20_000, 2))
    local = np.array([np.count_nonzero((xy * xy).sum(axis=1) <= 1.0), 20_000], dtype=np.int64)
    ref = np.empty_like(local)
    comm.Allreduce(local, ref)
    assert np.array_equal(total, ref)
    assert abs(pi - np.pi) < 0.1
    assert module.main(["--samples", "1000", "--algorithm", algorithm]) > 2.5


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "rabenseifner", "auto"])
def test_conjugate_gradient_matches_serial_solve_and_native_iterations(algorithm, capsys):
    module = load("conjugate_gradient")
    assert module.main(["--grid", "16", "--algorithm", algorithm, "--repeat", "1"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        assert capsys.readouterr().out.rstrip().endswith("ok")


@pytest.mark.mpi
def test_conjugate_gradient_iterations_equal_across_communicators():
    module = load("conjugate_gradient")
    world = MPI.COMM_WORLD
    u, iterations, _ = module.solve(mar.Comm(world, "tree"), 12)
    u_plain, plain_iterations, _ = module.solve(world, 12)
    assert iterations == plain_iterations > 0
    np.testing.assert_allclose(u, u_plain, rtol=1e-10, atol=1e-14)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_mpi4py_program_gives_the_plain_answer_through_mar_comm(algorithm):
    module = load("mpi4py_pi")
    world = MPI.COMM_WORLD
    pi, per_rank, squared = module.estimate(mar.Comm(world, algorithm), 5_000)
    plain_pi, plain_per_rank, plain_squared = module.estimate(world, 5_000)
    assert pi == plain_pi and np.array_equal(per_rank, plain_per_rank)
    assert squared == pytest.approx(plain_squared, rel=1e-12)
    assert abs(module.main() - np.pi) < 0.05


@pytest.mark.mpi
def test_conjugate_gradient_reproducible_history_is_the_one_rank_history(capsys):
    """--reproducible: r.r at every iteration has the bits of a single-rank solve, at any -n."""
    module = load("conjugate_gradient")
    world = MPI.COMM_WORLD
    history, alone = [], []
    module.solve(world, 16, history=history, reproducible=True)
    module.solve(MPI.COMM_SELF, 16, history=alone, reproducible=True)
    assert len(history) > 10
    assert [v.hex() for v in history] == [v.hex() for v in alone]
    assert module.main(["--grid", "16", "--repeat", "1", "--reproducible"]) == 0
    if world.rank == 0:
        out = capsys.readouterr().out
        printed = [line.split()[1] for line in out.splitlines() if line.startswith("  ")]
        assert printed == [v.hex() for v in alone]
        assert "time per iteration with mar.dot" in out
