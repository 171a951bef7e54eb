"""The per-job state of this machine that the cost model cannot take from a calibration run in
another job (issue 38, item 3): what reading lines the other rank has just written costs.

    python scripts/job_state.py [--jobs 10] [--ranks 2]

Each job (its own ``mpirun``) has every rank write its half of a shared window, meet at a
barrier, and add the other rank's freshly written half to a private array (``peer``), then the
same add on two private arrays (``private``): best of a block of rounds, three blocks in a row,
64 KiB. ``peer - private`` per byte is the cross-core transfer the model's ``shm_peer`` stands
for. It also times ``shm`` (best of its calls) at 8 and 64 KiB out of place: the small
regime's time per byte, which reads the peer's slot the same way, and the best call of a few
point-to-point algorithms at 64 KiB. One line per job, then the
jobs' transfer costs sorted and split at their widest gap: where the jobs fall into two states,
a calibration taken in one state predicts a bench in the other with the wrong ``shm_peer``.
Best-of timing leaves other jobs' scheduler slices out; ``uptime`` heads the output.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: bytes each rank writes and the other reads
PROBE_BYTES = 64 << 10
#: rounds per block, blocks per job
ROUNDS, BLOCKS = 100, 3
#: shm's small-regime sizes whose best times give its time per byte
SHM_SIZES = (8 << 10, 64 << 10)
#: point-to-point algorithms also timed (best call) at the larger size: whether the state
#: moves them too, and by how much
OTHERS = ("native", "ring", "recursive_doubling")


def probe() -> None:
    """One job's measurements; rank 0 prints them as a JSON line."""
    import numpy as np
    from mpi4py import MPI

    import mpiallreduce as mar

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    count = PROBE_BYTES // 4
    window = MPI.Win.Allocate_shared(size * PROBE_BYTES if rank == 0 else 0, 1, comm=comm)
    try:
        memory, _ = window.Shared_query(0)
        halves = np.frombuffer(memory, np.float32, count=size * count).reshape(size, count)
        mine, peer = halves[rank], halves[(rank + 1) % size]
        private, result = np.ones(count, np.float32), np.empty(count, np.float32)
        blocks = []
        for _ in range(BLOCKS):
            best = {"peer": float("inf"), "private": float("inf")}
            for value in range(ROUNDS):
                mine[:] = value  # written by this rank's core
                comm.Barrier()
                for name, operand in (("peer", peer), ("private", private)):
                    start = time.perf_counter()
                    np.add(operand, private, out=result)
                    best[name] = min(best[name], time.perf_counter() - start)
                comm.Barrier()
            blocks.append({name: comm.allreduce(seconds, MPI.MAX) / PROBE_BYTES
                           for name, seconds in best.items()})
    finally:
        window.Free()

    def best_call(algorithm: str, nbytes: int, calls: int = 400) -> float:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        for _ in range(50):
            mar.allreduce(x, y, comm=comm, algorithm=algorithm)
        comm.Barrier()
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            mar.allreduce(x, y, comm=comm, algorithm=algorithm)
            best = min(best, time.perf_counter() - start)
        return comm.allreduce(best, MPI.MAX)

    shm = {nbytes: best_call("shm", nbytes) for nbytes in SHM_SIZES}
    others = {name: best_call(name, SHM_SIZES[1], 200) for name in OTHERS}
    if rank == 0:
        slope = (shm[SHM_SIZES[1]] - shm[SHM_SIZES[0]]) / (SHM_SIZES[1] - SHM_SIZES[0])
        print(json.dumps({"blocks": blocks, "shm_s_per_byte": slope, "at_64k_s": others,
                          "load": os.getloadavg()[0]}), flush=True)


def transfer(job: dict) -> float:
    """A job's cross-core transfer per byte: the least over its blocks of peer less private."""
    return min(block["peer"] - block["private"] for block in job["blocks"])


def split(values: list[float]) -> tuple[list[float], list[float]]:
    """``values`` sorted and cut at their widest ratio between neighbours (two states)."""
    ordered = sorted(values)
    if len(ordered) < 2:
        return ordered, []
    floor = 1e-15  # a transfer measured at or below 0 (noise) counts as this small
    ratios = [max(b, floor) / max(a, floor) for a, b in zip(ordered, ordered[1:])]
    cut = ratios.index(max(ratios)) + 1
    return ordered[:cut], ordered[cut:]


def summary(jobs: list[dict]) -> list[str]:
    """Lines: the two states of the jobs' transfer cost (count, range, median), their ratio."""
    low, high = split([transfer(job) for job in jobs])
    lines = []
    for name, group in (("fast", low), ("slow", high)):
        if group:
            lines.append(f"# {name} state: {len(group)} jobs, transfer {group[0] * 1e9:.3f}-"
                         f"{group[-1] * 1e9:.3f} ns/B, median "
                         f"{group[len(group) // 2] * 1e9:.3f}")
    if low and high and low[len(low) // 2] > 0:
        lines.append(f"# slow / fast (medians): {high[len(high) // 2] / low[len(low) // 2]:.1f}x")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.probe:
        probe()
        return 0
    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    command = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(opts.ranks),
               sys.executable, "-m", "mpi4py", str(pathlib.Path(__file__).resolve()), "--probe"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {uptime}")
    print("# job  transfer by block (ns/B)        private (ns/B)  shm 8-64 KiB (ns/B)  "
          + "  ".join(f"{name[:9]:>9}" for name in OTHERS) + " at 64 KiB (us)  load")
    jobs = []
    for index in range(opts.jobs):
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                             check=True)
        job = json.loads(run.stdout.strip().splitlines()[-1])
        jobs.append(job)
        by_block = " ".join(f"{(b['peer'] - b['private']) * 1e9:6.3f}" for b in job["blocks"])
        private = min(b["private"] for b in job["blocks"]) * 1e9
        print(f"  {index:>3}  {by_block:<30} {private:>14.3f} "
              f"{job['shm_s_per_byte'] * 1e9:>20.3f}  "
              + "  ".join(f"{job['at_64k_s'][name] * 1e6:>9.1f}" for name in OTHERS)
              + f" {job['load']:>19.1f}", flush=True)
    print("\n".join(summary(jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
