"""The cross-rank agreement check (``check=True``): one small constant-size collective.

Every rank contributes its signature (a bad-input flag, count, dtype, op, algorithm, root,
parameter and topology checksums, whether a timeout is set, the checksum of the tuning table
``auto`` reads, whether the native library saturates 8/16-bit sums) together with its
negation, and one ``Allreduce(MAX)`` of those 2 x 11 int64 (176 bytes per rank, whatever the
number of ranks) gives every rank the maximum and the
minimum of every field. Where they are equal everywhere and no rank flagged bad input, the
call goes ahead. Otherwise, and only then, the ranks
exchange their full signatures and error messages (an ``allgather``: every rank got past the
first collective, so it cannot hang) and raise the same exception on every rank.

The check runs on a duplicate of its own (``CommState.checker``), so a rank that skips it
(``check=False`` where others check) leaves the others waiting, or timing out, instead of
matching data with signatures. A one-shot allreduce whose run is ``shm`` skips it altogether
(``prepare``'s ``checks_itself``): the run's header signature carries these fields and a
difference raises through :func:`disagree` on every rank (:mod:`.shm`). User ops are told
apart only by commutativity: MPI gives no rank-independent name for them.
"""

from __future__ import annotations

from array import array

from mpi4py import MPI

from ._checks import COLLECTIVE_ALGORITHMS, check_comm
from ._revoke import ready_or_heard
from ._state import state as comm_state
from ._waiting import MPI_CANNOT_SAY, check_timeout, deadline_of, wait_until
from .errors import CollectiveTimeout
from .shm import CHECK_KEYVAL, KIND_CHECK, signature_words
from .shm.protocol import UNKNOWN, differs
from .shm.protocol import name_ranks as _ranks

#: field names of the signature; the first is the bad-input flag.
FIELDS = ("", "count", "dtype", "op", "algorithm", "root", "algorithm parameters", "topology",
          "timeout", "tuning table", "auto's inputs")
# UNKNOWN (protocol's): a signature field a rank could not determine (its own input was bad);
# describe and differs (protocol's): the one mismatch report, shm's signatures' and this one's


def bad_signature() -> list[int]:
    return [1] + [UNKNOWN] * (len(FIELDS) - 1)


class Signature:
    """A signature packed for the check: ``[fields..., -fields...]`` and room for the result."""

    __slots__ = ("fields", "packed", "result", "shm", "carried")

    def __init__(self, fields: list[int]):
        self.fields = fields
        self.packed = array("q", fields + [-value for value in fields])
        self.result = array("q", bytes(8 * len(self.packed)))
        # as written into a shared-memory header (mpiallreduce.shm), where the ranks share one;
        # its last word is *carried*: sent along to every rank, not compared (see
        # shm.Node.agree); ``carried`` is then every rank's such word, a list in rank order
        # (None where the check ran as a collective)
        self.shm = memoryview(array("q", signature_words(KIND_CHECK, fields)))
        self.carried = None


def agree(checker: MPI.Intracomm, what: str, signature: Signature, error: Exception | None,
          names: tuple[str, ...], timeout: float | None = None, state=None) -> None:
    """Raise the same exception on every rank if any rank's input was bad or ranks disagree.

    ``state``: the communicator's (``CommState``). With a ``timeout``, its ``fail`` revokes the
    communicator and raises CollectiveTimeout when it passes. The check hears the
    communicator's alarm (:mod:`._revoke`): before its blocking collective (which nothing can
    interrupt), and in its polled one. Where the ranks share one node's memory (after the first
    ``shm`` call), the check runs over the shared headers instead of a collective
    (:meth:`mpiallreduce.shm.Node.agree`).
    """
    try:
        node = checker.Get_attr(CHECK_KEYVAL)
        if node is not None:
            if not node.agree(signature, timeout, what, _ignore if state is None else state.fail) \
                    or error is not None:
                disagree(checker, what, signature.fields, error, names)
            return
        where = f"{what} on rank {checker.Get_rank()}"
        if timeout is None:
            if state is not None:
                state.check_alarm(where)
            checker.Allreduce(signature.packed, signature.result, MPI.MAX)
        else:
            requests = [checker.Iallreduce(signature.packed, signature.result, MPI.MAX)]
            ready = ready_or_heard(requests, None if state is None else state.alarm,
                                   lambda: state.hear(state.alarm.heard, where, requests,
                                                      (signature,)))
            if not wait_until(ready, deadline_of(timeout)):
                (state.fail if state is not None else _raise)(
                    f"{where}: the argument check did not complete within {timeout:g} s; some "
                    f"rank of the communicator has not made this call, or runs calls on it in a "
                    f"different order, or passed check=False (no data has moved yet; the check "
                    f"is one MPI collective, and {MPI_CANNOT_SAY})", requests, (signature,))
        if signature.result == signature.packed and error is None:
            return
        disagree(checker, what, signature.fields, error, names)
    finally:
        error = None  # the exception, raised through this frame, would hold it: a cycle


def _ignore(*args) -> None:
    pass


def _raise(reason: str, *args) -> None:
    raise CollectiveTimeout(reason)


def disagree(checker: MPI.Intracomm, what: str, mine: list[int], error: Exception | None,
             names: tuple[str, ...]) -> None:
    """The slow path: exchange signatures and errors, raise one exception on every rank."""
    try:
        table = checker.allgather((mine, None if error is None else (type(error), str(error))))
        failed = [rank for rank, (fields, _) in enumerate(table) if fields[0]]
        if failed:
            reports = [table[rank][1] for rank in failed]
            if error is not None and len(failed) == len(table) and len(set(reports)) == 1:
                raise error  # the same bad input everywhere: the plain local message
            groups: dict[tuple, list[int]] = {}
            for rank, report in zip(failed, reports):
                groups.setdefault(report, []).append(rank)
            message = f"{what}: bad input on " + "; ".join(
                f"{_ranks(ranks)}: {text}" for (_, text), ranks in groups.items())
            raise _same_kind(reports[0][0], message) from error
        problems = []
        for column, name in enumerate(FIELDS):
            values = [fields[column] for fields, _ in table]
            if column == 0 or len(set(values)) == 1:
                continue
            if name == "auto's inputs":  # two facts in one word: say which of them differs
                problems.extend(_inputs_differ(values))
                continue
            problems.append(differs(name, values, names))
        if not problems:  # the same arguments, but not the same call at this point
            raise ValueError(f"{what}: ranks run different calls at this point with the same "
                             f"arguments (plans and calls on this communicator in different orders, "
                             f"or a call whose arguments some ranks check where others run a plan)")
        raise ValueError(f"{what} called with different arguments on different ranks: "
                         + "; ".join(problems))
    finally:
        error = None  # the exception, raised through this frame, would hold it: a cycle


def _inputs_differ(values: list[int]) -> list[str]:
    """What differs in the "auto's inputs" word (bit 1: in place; bit 2: in place on a shared
    array; bit 0: the native library saturates 8/16-bit sums), said as what each rank did."""
    problems = []
    for bit, what, says in ((2, "sendbuf", ("passed a send buffer", "passed MPI.IN_PLACE")),
                            (4, "recvbuf", ("passed a private array",
                                            "passed a shared array (mpiallreduce.shared_empty)")),
                            (1, "the MPI library", ("wraps 8/16-bit sums",
                                                    "saturates 8/16-bit sums"))):
        groups: dict[bool, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(bool(value & bit), []).append(rank)
        if len(groups) > 1:
            problems.append(f"{what} differs: " + "; ".join(
                f"{_ranks(ranks)} {says[flag]}" for flag, ranks in sorted(
                    groups.items(), key=lambda item: item[1][0])))
    return problems


def _same_kind(kind: type, message: str) -> Exception:
    """An exception of ``kind`` carrying ``message``, or a RuntimeError if kind needs more."""
    try:
        return kind(message)
    except Exception:
        return RuntimeError(f"{kind.__name__}: {message}")


def prepare(what: str, comm, check: bool, local_checks, collective: str = "allreduce",
            timeout=None, checks_itself=None, carry=None):
    """Run ``local_checks(comm)`` and, with ``check``, the agreement; return the checked call.

    The communicator's state is made first (its duplicates within ``timeout``). With ``check``,
    any exception the local checks raise on some rank is raised on every rank. Where
    ``checks_itself(call, state)`` says the call's run compares the agreement's fields itself
    (``_plans.checks_itself``: an shm run), a call that passed its local checks skips the
    agreement; a rank whose checks failed runs it, and the others' runs join its exchange.
    ``carry``: an object whose ``word(call)`` (an int64) the check carries where it runs over
    shared memory; its ``words`` is then set to every rank's (None where the check ran as a
    collective).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    check_comm(comm)
    valid = None
    try:
        check_timeout(timeout)
        valid = timeout  # the set-up and the check keep to a valid timeout even if input is bad
    except ValueError:
        if not check:
            raise
    state = comm_state(comm, valid, what)
    state.refuse_if_broken(what)
    if not check:
        return local_checks(comm)
    call = error = None
    try:
        check_timeout(timeout)
        call = local_checks(comm)
        if checks_itself is not None and checks_itself(call, state):
            return call
        signature = Signature(call.signature(timeout))
        if carry is not None:  # a word (int64) the check carries over shared memory
            signature.shm[-1] = carry.word(call)
    except Exception as exc:  # noqa: BLE001 - every kind must reach every rank
        error, signature = exc, Signature(bad_signature())
    try:
        agree(state.checker, what, signature, error, COLLECTIVE_ALGORITHMS[collective], valid,
              state)
    finally:
        error = None  # its traceback holds this frame: no cycle left for the garbage collector
    if carry is not None:
        carry.words = signature.carried
    return call
