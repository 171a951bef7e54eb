"""The words of the shared-memory protocol: header layout, signatures, regime sizes, the one
mismatch report (also :mod:`.._agree`'s), and the test hook that stalls protocol steps.

Terms (each defined once, here):

- *epoch*: the number a rank gives its shm calls on a communicator, one after the other
  (``Node.claim``); every rank gives the same call the same epoch.
- *parity slot*: the half of each rank's data window (and the signature area of its header)
  that epoch ``e`` uses, ``e % 2``. At epoch ``e`` every rank has seen every peer start
  ``e - 1``, so every peer has finished reading ``e - 2``: the slot is free again without an
  acknowledgement round.
- *publish*: write this rank's counter word (after its data and signature, with a fence where
  memory is weakly ordered), so that peers reading the counter may read what it covers.
- *arrive*: publish the step's counter, then wait until every peer published it too
  (``ShmPlan._arrive``); the first arrival of an epoch also compares the signatures.
- *signature*: the words a rank writes for its call (kind, a digest, the fields): peers compare
  the digest word before they read any data, so ranks running different calls raise instead
  of reducing each other's unrelated data.
"""

from __future__ import annotations

import platform
import random
import time

from .. import _shm_sizes
from .._shm_sizes import ALIGN, CHUNK_BYTES, MAX_CHUNKS, SMALL_BYTES, SMALL_BYTES_TWO_RANKS
from ..ops import DTYPES, OP_NAMES

# The regime and chunk sizes (SMALL_BYTES, SMALL_BYTES_TWO_RANKS, CHUNK_BYTES, MAX_CHUNKS,
# ALIGN) are :mod:`.._shm_sizes`' (the model reads the same definitions); they are names of
# this module too, which the functions below pass on, so that setting one here (``shm.X =``,
# as tests do) changes what the transport does.

#: bytes of each rank's header: counter, then two signatures (call parity), padded to four
#: 64-byte lines (two prefetch pairs) so that a peer's adjacent-line prefetch never pulls in
#: another rank's header.
HEADER_BYTES = 256
#: int64 words of a signature area (one per call parity): its kind, a digest of the whole, then
#: the fields (a peer compares the digest word alone on the hot path). A data
#: call writes count, dtype, op, plan, send block, send offset, recv block, recv offset and a
#: digest of its argument-check fields; the separate argument check (``check=True`` where the
#: run does not check itself) writes the eleven fields of :mod:`.._agree`.
SIGNATURE_WORDS = 14  # kind, digest, up to 12 fields; two areas fit the header
#: signature kinds: a data call's, and the argument check's (:meth:`.node.Node.agree`)
KIND_DATA, KIND_CHECK = 1, 2
DATA_FIELDS = ("count", "dtype", "op", "plan", "shared sendbuf", "sendbuf offset",
               "shared recvbuf", "recvbuf offset")
#: signature columns (after kind and digest) that say which plan runs on which memory: where
#: these differ, the local message names them; elsewhere the agreement's exchange does.
PLACEMENT = tuple(range(2 + DATA_FIELDS.index("plan"), 2 + len(DATA_FIELDS)))
#: smallest data window per rank (two parity slots); windows grow to the next power of two.
MIN_WINDOW = 64 << 10
#: the header word of the large regime's chunk steps (after the counter and the two
#: signature areas): ``epoch << 24`` plus the step, so it only grows.
STEP_WORD = 1 + 2 * SIGNATURE_WORDS
STEP_SHIFT = 24
#: counter reads a wait makes back to back before it yields the core between reads (none
#: where the node's ranks outnumber its cores).
SPIN_READS = 200
#: seconds a wait yields (``sched_yield``) between reads before it sleeps between them.
YIELD_SECONDS = 10e-3
#: CPUs whose ordering (TSO) makes the counter protocol safe without a fence.
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
#: whether a ``Win.Sync`` fence runs between data and counter (read when a node is made: a
#: test sets it to run the weakly ordered memory path on x86 too).
FENCE = platform.machine().lower() not in TSO_MACHINES


def small_bytes(nranks: int, shared: bool = False) -> int:
    """Most bytes per rank of the small regime for ``nranks`` ranks; ``shared``: a buffer is a
    shared array (the large regime reads it in place, with no copy)."""
    return _shm_sizes.small_bytes(nranks, shared, SMALL_BYTES, SMALL_BYTES_TWO_RANKS)


def digest(kind: int, fields) -> int:
    """Python's hash of a tuple of ints, as a non-negative int64: the same in every process
    (only str/bytes hashes are salted)."""
    return hash((kind, *(int(field) for field in fields))) & ((1 << 62) - 1)


def signature_words(kind: int, fields) -> list[int]:
    """A signature area's words: kind, digest, fields, zero padding."""
    fields = [int(field) for field in fields]
    return [kind, digest(kind, fields), *fields] + [0] * (SIGNATURE_WORDS - 2 - len(fields))


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of cache lines (:data:`ALIGN`)."""
    return _shm_sizes.round_up(nbytes, ALIGN)


def chunk_bytes(nbytes: int) -> int:
    """Bytes per chunk of the large regime for a message of ``nbytes`` (agreed on every rank)."""
    return _shm_sizes.chunk_bytes(nbytes, CHUNK_BYTES, MAX_CHUNKS, ALIGN)


def slot_bytes(nbytes: int) -> int:
    """Bytes per parity slot an shm plan of ``nbytes`` needs: the whole message up to the
    small regime's limit or two chunks, then two chunk buffers (a function of the agreed count
    alone, so every rank grows the window at the same call)."""
    return min(nbytes, max(2 * chunk_bytes(nbytes), SMALL_BYTES, SMALL_BYTES_TWO_RANKS))


# -- the one mismatch report (shm's signatures and the agreement's exchange) -------------------

#: a signature field a rank could not determine (its own input was bad: :mod:`.._agree`).
UNKNOWN = -9


def describe(name: str, value: int, algorithms: tuple[str, ...] = ()) -> str:
    """Say what ``value`` of the signature field ``name`` means (``algorithms``: the names the
    "algorithm" field indexes)."""
    if value == UNKNOWN:  # (never a value of a data signature's fields)
        return "unknown (bad input)"
    if name == "dtype" and 0 <= value < len(DTYPES):
        return DTYPES[value].name
    if name == "op":
        return {-1: "a commutative user op", -2: "a non-commutative user op",
                -3: "no op"}.get(value, OP_NAMES[value] if 0 <= value < len(OP_NAMES)
                                 else str(value))
    if name == "plan":
        return "a one-shot call" if value == 0 else f"plan #{value}"
    if name.startswith("shared"):
        return "a private array" if value == -1 else f"shared array #{value}"
    if name == "algorithm" and 0 <= value < len(algorithms):
        return algorithms[value]
    if name == "algorithm parameters":
        return f"parameters with checksum {value}"
    if name == "topology":
        return "no topology" if value == -1 else f"a topology with checksum {value}"
    if name == "timeout":
        return "a timeout" if value else "no timeout"
    if name == "tuning table":
        return "no tuning table" if value == 0 else f"a tuning table with checksum {value}"
    if name == "auto's inputs":  # bit 0: native saturates 8/16-bit sums; bit 1: in place;
        # bit 2: in place on a shared array
        return (("in place" if value & 2 else "out of place")
                + (" on a shared array" if value & 4 else "") + ", a native library that "
                + ("saturates" if value & 1 else "wraps"))
    return str(value)


def name_ranks(ranks) -> str:
    """``"rank 2"``, ``"ranks 0, 2"``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def differs(name: str, values, algorithms: tuple[str, ...] = ()) -> str | None:
    """``"<name> differs: <value> on rank 0; <value> on ranks 1, 2"`` for one signature field
    (``values`` in rank order), or None where every rank has the same value."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    if len(groups) < 2:
        return None
    return f"{name} differs: " + "; ".join(
        f"{describe(name, value, algorithms)} on {name_ranks(ranks)}"
        for value, ranks in groups.items())


# -- the test hook: stalls between protocol steps ---------------------------------------------

class Stalls:
    """Random short sleeps at the protocol's step boundaries, for tests (:data:`STALLS`).

    Each rank draws from its own generator (``seed`` and its rank): at every bound phase of a
    plan (arrive, wait, reduce, copy out, each chunk's) it sleeps with ``probability``, for up
    to ``longest`` seconds, so different ranks reach different steps at different times.
    """

    def __init__(self, seed: int = 0, probability: float = 0.3, longest: float = 3e-4):
        self.seed, self.probability, self.longest = seed, probability, longest
        self._random: random.Random | None = None

    def bind(self, rank: int) -> None:
        if self._random is None:
            self._random = random.Random(self.seed * 7919 + rank)

    def __call__(self) -> None:
        draw = self._random.random
        if draw() < self.probability:
            time.sleep(draw() * self.longest)


#: the test hook: None in production (plans are bound as they are, nothing checked at run
#: time); a :class:`Stalls` makes every plan bound while it is set sleep at random between its
#: protocol steps (tests/test_shm_stress_mpi.py).
STALLS: Stalls | None = None


class Stalled:
    """A plan's phase hook (``phase(kind, index, calls)``) with a stall before every phase; the
    hook it wraps (a tracer's marks) answers everything else."""

    def __init__(self, phase, stalls: Stalls):
        self._inner, self._stalls = phase, stalls

    def __call__(self, kind, index, calls):
        return [self._stalls, *self._inner(kind, index, calls)]

    def __getattr__(self, name):
        return getattr(self._inner, name)
