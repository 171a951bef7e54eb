"""A measured table gives the same ``auto`` choice on every rank, and that choice runs correctly."""

import os
import tempfile

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import select
from mpiallreduce.ops import reducer

pytestmark = pytest.mark.mpi


@pytest.fixture
def shared_table(monkeypatch):
    """A table for this communicator size, written by rank 0 where every rank can read it."""
    comm = MPI.COMM_WORLD
    folder = comm.bcast(tempfile.mkdtemp(prefix="mar-tune-") if comm.rank == 0 else None)
    path = os.path.join(folder, "tuning.json")
    if comm.rank == 0:
        select.write_table(path, {"nranks": comm.size, "classes": {
            "commutative": [{"min_bytes": 0, "max_bytes": 64, "algorithm": "knomial"},
                            {"min_bytes": 64, "max_bytes": 4096, "algorithm": "tree"},
                            {"min_bytes": 4096, "max_bytes": None, "algorithm": "rabenseifner"}],
            "noncommutative": [{"min_bytes": 0, "max_bytes": None, "algorithm": "knomial"}]}})
    comm.Barrier()
    monkeypatch.setenv(select.TUNING_ENV, path)
    select.reload()
    yield path
    select.reload()
    comm.Barrier()
    if comm.rank == 0:
        os.remove(path)
        os.rmdir(folder)


def test_the_choice_is_identical_on_every_rank(shared_table):
    comm = MPI.COMM_WORLD
    red = reducer(MPI.SUM, np.dtype("float64"))
    picks = [select.choose(comm.size, 8 << shift, red) for shift in range(0, 28, 3)]
    assert len({tuple(p) for p in comm.allgather(picks)}) == 1
    if comm.size > 1:
        assert picks[0] == "knomial" and picks[-1] == "rabenseifner"
    assert comm.allgather(select.digest()) == [select.digest()] * comm.size


@pytest.mark.parametrize("count", [1, 7, 100, 5000])
def test_auto_runs_what_the_table_says_and_matches_native(shared_table, count):
    comm = MPI.COMM_WORLD
    x = contribution(comm, count, "float64")
    with mar.plan(x, comm=comm, algorithm="auto") as p:
        names = comm.allgather(p.algorithm)
        assert len(set(names)) == 1
        if comm.size > 1:
            assert names[0] == select.choose(comm.size, x.nbytes, reducer(MPI.SUM, x.dtype))
        assert_matches_native(comm, x, p.run(), MPI.SUM)
