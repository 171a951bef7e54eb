"""What MPI's own allreduce runs: Open MPI 5.0 coll/tuned's fixed decision, as schedules."""

from __future__ import annotations

#: native is modelled as Open MPI 5.0's coll/tuned fixed decision, which is what runs on one
#: node (coll/han, priority 35, steps aside without remote peers; tuned has 30):
#: ``ompi_coll_tuned_allreduce_intra_dec_fixed`` in ``coll_tuned_decision_fixed.c``. Rows:
#: (communicator sizes below, ((bytes per rank below, algorithm), ...)), None for no bound.
#: Open MPI's algorithms: 1 basic_linear, 2 nonoverlapping (reduce + bcast), 3 recursive
#: doubling, 4 ring, 5 segmented ring (with the table's segment size 0 it runs the ring),
#: 6 Rabenseifner.
OMPI_ALLREDUCE_COMMUTATIVE = (
    (4, ((8, 4), (4096, 3), (8192, 4), (16384, 3), (65536, 4), (262144, 5), (None, 6))),
    (8, ((16, 4), (8192, 3), (None, 6))),
    (16, ((8192, 3), (None, 6))),
    (32, ((64, 5), (4096, 3), (None, 6))),
    (64, ((128, 5), (None, 6))),
    (128, ((262144, 3), (None, 6))),
    (256, ((131072, 2), (262144, 3), (None, 6))),
    (512, ((4096, 2), (None, 6))),
    (2048, ((2048, 2), (16384, 3), (None, 6))),
    (4096, ((2048, 2), (4096, 5), (16384, 3), (None, 6))),
    (None, ((2048, 2), (16384, 5), (32768, 3), (None, 6))),
)
OMPI_ALLREDUCE_NONCOMMUTATIVE = (
    (4, ((131072, 3), (None, 1))),
    (8, ((None, 3),)),
    (16, ((1048576, 3), (None, 2))),
    (128, ((None, 3),)),
    (256, ((131072, 2), (524288, 3), (None, 2))),
    (512, ((4096, 2), (524288, 3), (None, 2))),
    (None, ((2048, 2), (None, 3))),
)
#: Open MPI's algorithms that copy the whole message per call, out of place: recursive
#: doubling allocates a temporary and copies the input into it, the ring copies sendbuf into
#: recvbuf, Rabenseifner allocates a temporary and copies sendbuf into recvbuf.
OMPI_COPIES = frozenset({3, 4, 5, 6})
#: bytes from which a malloc is mapped afresh on every call: glibc's largest dynamic mmap
#: threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x sizeof(long)); below it a freed
#: temporary returns to the heap and the next call reuses its pages. Open MPI's recursive
#: doubling and Rabenseifner malloc a whole-message temporary per call, so from here their
#: receives fault its pages in every call (at 2 ranks native in place at 64 MiB lost to our
#: Rabenseifner by far, and matched it once MALLOC_MMAP_THRESHOLD_ lay above the
#: message: the faults are the whole difference).
OMPI_FRESH_BYTES = 32 << 20


def _ompi_choice(nranks: int, nbytes: int, commutative: bool) -> int:
    """Open MPI 5.0 coll/tuned's fixed allreduce algorithm number for (p, bytes per rank)."""
    table = OMPI_ALLREDUCE_COMMUTATIVE if commutative else OMPI_ALLREDUCE_NONCOMMUTATIVE
    for ranks_below, rows in table:
        if ranks_below is None or nranks < ranks_below:
            return next(algorithm for below, algorithm in rows if below is None or nbytes < below)
    raise AssertionError("the last row of the decision table has no bound")


def native_algorithm(nranks: int, nbytes: int, itemsize: int = 4, commutative: bool = True
                     ) -> str:
    """The schedule that stands in for what Open MPI 5.0's default allreduce runs.

    Open MPI's ring (and its segmented ring at segment size 0) runs recursive doubling below
    p elements, its Rabenseifner runs basic_linear below pof2 elements; basic_linear and
    nonoverlapping (a reduce to rank 0, then a broadcast) are stood in for by ``tree``.
    """
    count = nbytes // itemsize
    pof2 = 1 << (max(nranks, 1).bit_length() - 1)
    choice = _ompi_choice(nranks, nbytes, commutative)
    if choice in (4, 5):
        return "ring" if count >= nranks else "recursive_doubling"
    if choice == 6 and count >= pof2:
        return "rabenseifner"
    return "recursive_doubling" if choice == 3 else "tree"
