"""Picks kept across jobs (:mod:`mpiallreduce.picks`) at every rank count: a second
communicator (a second job's) starts with the first one's decisions, the same on every rank,
and runs no learning call for them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from conftest import assert_on_every_rank, repeat_auto
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _state, learn, picks, select

pytestmark = pytest.mark.mpi

SIZES = (1, 1000, 70_000)  # counts of float64


@pytest.fixture
def kept(monkeypatch):
    """Learning on (three timed runs per candidate), the picks in a file of rank 0's choosing
    (a folder rank 0 alone makes: pytest's own temporary folders are every rank's, and their
    clean-ups race)."""
    folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="picks-")
                                  if MPI.COMM_WORLD.rank == 0 else None)
    where = os.path.join(folder, "learned.json")
    monkeypatch.setenv(picks.PATH_ENV, where)
    monkeypatch.setenv(select.LEARN_ENV, "on")
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "3")
    monkeypatch.delenv(select.RELEARN_ENV, raising=False)
    monkeypatch.delenv(picks.DAYS_ENV, raising=False)
    monkeypatch.setattr(select, "LEARN_MIN_SECONDS", 0.0)  # small cases learn too
    monkeypatch.setattr(select, "LEARN_MIN_BYTES", 0)
    monkeypatch.setattr(select, "LEARN_FLOOR_BYTES", 0)
    yield where
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _job(in_place: bool) -> dict:
    """What one job runs: each size repeated past its learning, on a communicator of its own."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        for count in SIZES:
            repeat_auto(comm, count, in_place, select.LEARN_CALLS + 5)
        state = _state.existing(comm)
        return {} if state is None else {r.key[0]: r for r in learn.records(state).values()}
    finally:
        comm.Free()


@pytest.mark.parametrize("in_place", [False, True])
def test_a_second_job_starts_with_the_first_jobs_picks(kept, in_place):
    first = _job(in_place)
    second = _job(in_place)
    comm = MPI.COMM_WORLD
    if comm.size == 1:
        assert first == second == {}  # one rank: nothing to learn, nothing kept
        return
    assert first.keys() == second.keys() and len(first) == len(SIZES)
    for bucket, record in first.items():
        again = second[bucket]
        assert record.learning_calls > 0 and not record.remembered
        assert again.learning_calls == 0 and again.remembered
        assert again.winner == record.winner
        assert again.verdict == record.verdict
    picked = sorted((bucket, r.winner, r.verdict.text) for bucket, r in second.items())
    assert_on_every_rank(comm, None if len(set(map(repr, comm.allgather(picked)))) == 1
                         else f"rank {comm.rank}: kept picks differ across ranks: {picked}")
    nnodes = mar.Topology.from_comm(comm).nnodes  # (collective)
    if comm.rank == 0:
        with open(kept, encoding="utf-8") as file:
            (machine,) = json.load(file)["machines"].values()
        assert len(machine["cases"]) == len(SIZES)
        assert machine["fingerprint"]["nodes"] == nnodes


def test_picks_older_than_the_setting_are_learned_again(kept, monkeypatch):
    _job(False)
    monkeypatch.setenv(picks.DAYS_ENV, "0")
    again = _job(False)
    if MPI.COMM_WORLD.size > 1:
        assert again and all(r.learning_calls > 0 and not r.remembered for r in again.values())
