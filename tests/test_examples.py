"""The examples are importable and give the same answer as MPI's own Allreduce."""

import importlib.util
import pathlib

import numpy as np
import pytest
from mpi4py import MPI

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
