"""``mpiallreduce.calibrate`` under mpirun: every field it measures comes back on every rank, and the
machine round-trips through its file (a quick calibration: few sizes, small buffers)."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpiallreduce.calibrate import LIBRARY_ALGORITHMS, LIBRARY_SIZES, calibrate
from mpiallreduce.model import Machine, machine_from, predict
from mpiallreduce.model.fit import REUSE_ALGORITHM, REUSE_SIZES, SHM_PEER_BYTES
from mpiallreduce.shm import small_bytes

pytestmark = pytest.mark.mpi


def test_calibrate_measures_every_term_on_every_rank():
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            calibrate(comm)
        return
    if comm.Get_size() > 2:
        pytest.skip("calibrate measures ranks 0 and 1; the others only wait (run at -n 2)")
    sizes = (1, 64, 4096, 1 << 16)
    machine = calibrate(comm, sizes=sizes, rate_sizes=(4096, 1 << 16), bandwidth_bytes=1 << 20)
    link = machine.intra
    assert [b for b, _ in link.curve] == list(sizes)
    assert all(t > 0 for _, t in link.curve) and link.alpha >= 0 and link.beta >= 0
    assert [b for b, _ in machine.gamma_curve] == [4096, 1 << 16] == [
        b for b, _ in machine.copy_curve]
    assert min(machine.request, machine.combine, machine.step, machine.call,
               machine.native_call, machine.shm_small, machine.shm_large, machine.shm_peer) >= 0
    assert machine.node_bandwidth > 0 and machine.cores >= 1
    assert [b for b, _ in machine.node_curve] == [4096, 1 << 16, 1 << 20]
    # the shm regimes: 8 B, half the limit, twice it; and the small regime where it calls
    # NumPy (int32, which the compiled path leaves to it) for shm_call
    limit = small_bytes(comm.Get_size())
    assert set(machine.info["shm_run_s"]) == {"8", str(SHM_PEER_BYTES), str(limit // 2),
                                              str(2 * limit)}
    assert [b for b, _ in machine.shm_peer_curve] == [SHM_PEER_BYTES, limit // 2]
    assert set(machine.info["measurements"]["shm_numpy_run_s"]) == {"2048"}
    assert machine.shm_call >= 0 and machine.fault >= 0
    # hierarchical over shared memory on this node, in shm's two regimes
    assert set(machine.info["hierarchical_shm_run_s"]) == {"8", str(2 * limit)}
    assert machine.phased_small >= 0 and machine.phased_large >= 0
    assert set(machine.info["plan_run_s"]) >= {"chain per step", "exchange per step",
                                               "reducing exchange per step"}
    # MPI's blocking exchange for native's messages, at the ping-pong's sizes
    assert [b for b, _ in machine.native_link.curve] == list(sizes)
    assert all(t >= 0 for _, t in machine.native_link.curve)
    measured = machine.info["measurements"]
    offsets = {round(e - t, 15) for (b, t), e in zip(machine.native_link.curve,
                                                      measured["sendrecv_s"]) if t > 0}
    assert len(offsets) == 1, offsets  # every size less one call cost (all <= 64 KiB here)
    # the library's own runs, every algorithm, size and mode, that the per-call terms fit
    runs = machine.info["measurements"]["library_runs"]
    assert sorted((r["algorithm"], r["size"], r["in_place"]) for r in runs) == sorted(
        (name, size, mode) for name in LIBRARY_ALGORITHMS for size in LIBRARY_SIZES
        for mode in (False, True))
    assert all(r["avg_us"] > 0 for r in runs)
    # a send and a receive buffer; recursive doubling in place against out of place, whose
    # difference (per byte it reuses) is the reuse curve, at every size measured
    assert machine.info["measurements"]["pingpong_buffers"] == 2
    reuse = machine.info["measurements"]["reuse_runs"]
    assert sorted((r["algorithm"], r["size"], r["in_place"]) for r in reuse) == sorted(
        (REUSE_ALGORITHM, size, mode) for size in REUSE_SIZES for mode in (False, True))
    assert all(r["avg_us"] > 0 for r in reuse)
    assert [b for b, _ in machine.reuse_curve] == list(REUSE_SIZES)
    assert min(rate for _, rate in machine.reuse_curve) >= 0
    # one machine on every rank (rank 0's measurements, broadcast)
    assert comm.allgather(machine.to_dict()) == [machine.to_dict()] * comm.Get_size()
    assert Machine.from_dict(machine.to_dict()) == machine
    assert predict("ring", 2, 1 << 20, machine=machine).time > 0
    # the file keeps the measurements: the same machine refits from them without MPI
    refit = machine_from(machine.info["measurements"])
    assert refit.to_dict()["intra"] == machine.to_dict()["intra"]
    assert (refit.step, refit.shm_small, refit.native_call) == (
        machine.step, machine.shm_small, machine.native_call)
