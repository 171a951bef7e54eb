"""Revocation: what a communicator is once one of its ranks gives up on a collective.

Terms (each defined once, here):

- *give up*: a rank ends a collective before it completed: its ``timeout`` passed, or an
  exception (an error in a user op, a Ctrl-C in a wait) left the run in the middle.
- *revoke*: what the rank that gives up does, once: it refuses the communicator from then on,
  sends the *alarm* to every other rank and *marks* its headers in shared memory.
- *alarm*: a small message on the communicator's ``checker`` duplicate (tag
  :data:`ALARM_TAG`, which nothing else there uses) that says who gave up on what. Every rank
  keeps one receive for it posted (:class:`Alarm`); its waits test it, so a rank still waiting
  in the abandoned call (or in any later one) raises :class:`CommunicatorRevoked` instead of
  waiting forever, and a message-passing run tests it once more before it returns.
- *mark*: this rank's counter and chunk-step words in a node's header set to
  ``-(1 + rank)``, below anything a peer waits for: a peer's wait leaves its fast path, finds
  the mark, and raises (the alarm tells the reason).

Why a late rank can never return the abandoned call's data: on one node the mark replaces the
counter a peer must read before it reads a slot; across nodes every wait and the end of every
message-passing run test the alarm, which the rank that gave up sent before it returned. MPI
itself gives no way to wake a rank blocked inside MPI's own blocking collective (``native``
without ``timeout=``, the argument check's collective where the ranks span nodes): that rank
waits there; with ``timeout=`` those calls poll, and hear the alarm.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ._waiting import tested
from .errors import CommunicatorRevoked

#: the alarm's tag on the checker duplicate (which carries only collectives besides it).
ALARM_TAG = 7
#: most bytes of an alarm's text (the reason, cut there).
ALARM_BYTES = 2048
#: seconds a rank that found a mark waits for the alarm that says why (it was sent first).
REASON_SECONDS = 0.05
#: what a refusal tells the user to do.
HOW_TO_GO_ON = ("call mpiallreduce.recover(comm) on every rank (or use a fresh comm.Dup() of "
                "the parent) to go on")


class Revocation:
    """Who gave up (``rank`` of the communicator) and what it said (``reason``)."""

    __slots__ = ("rank", "reason")

    def __init__(self, rank: int | None, reason: str):
        self.rank, self.reason = rank, reason

    def error(self, where: str) -> CommunicatorRevoked:
        """The exception ``where`` (``"<call> on rank r"``) raises."""
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        return CommunicatorRevoked(
            f"{where}: the communicator is revoked: {who} gave up on a collective "
            f"({self.reason}); no mpiallreduce call on it can run again: {HOW_TO_GO_ON}",
            self.rank, self.reason)


def mark_of(rank: int) -> int:
    """The header word that marks ``rank``'s give-up (negative: below every target)."""
    return -1 - rank


def marked_rank(word: int) -> int:
    """The rank a negative header word marks (:func:`mark_of`)."""
    return -1 - word


class Alarm:
    """One rank's end of the alarm channel of a communicator (``comm``: its checker duplicate):
    the receive kept posted for any rank's alarm, and the alarms this rank sent."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.buffer = bytearray(ALARM_BYTES)
        self.status = MPI.Status()
        self.request = (comm.Irecv([self.buffer, MPI.BYTE], MPI.ANY_SOURCE, ALARM_TAG)
                        if self.size > 1 else MPI.REQUEST_NULL)
        self.heard: Revocation | None = None
        self.sent: list = []  # (request, payload): never waited, a peer may never receive

    def test(self) -> Revocation | None:
        """The revocation heard so far, testing the receive (None: nobody gave up yet)."""
        if self.heard is None and self.size > 1 and self.request.Test(self.status):
            self.landed(self.status)
        return self.heard

    def landed(self, status: MPI.Status) -> None:
        """The receive completed (tested or waited for with ``status``): read who and why."""
        if self.heard is None:
            text = bytes(self.buffer[:status.Get_count(MPI.BYTE)]).decode(errors="replace")
            self.heard = Revocation(status.Get_source(), text)

    def reason_from(self, rank: int) -> Revocation:
        """What ``rank``, whose mark this rank found, said: its alarm, waited for a moment (it
        sent it before it marked), else the mark alone."""
        deadline = time.monotonic() + REASON_SECONDS
        while self.test() is None and time.monotonic() < deadline:
            time.sleep(1e-4)
        if self.heard is not None:
            return self.heard
        return Revocation(rank, "its mark in shared memory; its alarm did not arrive")

    def send(self, reason: str) -> None:
        """Tell every other rank that this one gave up (``reason``), without waiting."""
        payload = reason.encode()[:ALARM_BYTES]
        for peer in range(self.size):
            if peer != self.rank:
                self.sent.append((self.comm.Isend([payload, MPI.BYTE], peer, ALARM_TAG), payload))

    def close(self) -> None:
        """Withdraw the posted receive (the communicator is being freed, healthy)."""
        if self.size > 1 and self.heard is None and not self.request.Test(self.status):
            self.request.Cancel()
            self.request.Wait()


class WatchedWait:
    """The wait of a step without deadline that also hears the alarm: each of ``requests``
    tested (the usual case: done, or about to be), then MPI's ``Waitany`` over those still
    pending and the alarm's receive (blocking in MPI, as ``Wait`` does) until each completed,
    or the alarm came: then ``on_alarm()``, which raises. ``requests`` may be a list a run
    refills (a step posted afresh): it is read at each wait. A request ``Waitany`` completed
    is never tested again (MPICH's ``Testall`` fails on a persistent collective request that
    ``Waitany`` completed)."""

    __slots__ = ("requests", "alarm", "on_alarm", "status")

    def __init__(self, requests, alarm: Alarm, on_alarm):
        self.requests, self.alarm, self.on_alarm = requests, alarm, on_alarm
        self.status = MPI.Status()

    def __call__(self) -> None:
        pending = [request for request in self.requests if not request.Test()]
        if not pending:
            return
        left = alarm = len(pending)
        watched, waitany = [*pending, self.alarm.request], MPI.Request.Waitany
        while left:
            index = waitany(watched, self.status)
            if index == alarm:
                self.alarm.landed(self.status)
                self.on_alarm()
                raise AssertionError("on_alarm() must raise")  # pragma: no cover
            if index == MPI.UNDEFINED:  # (every request complete, the alarm heard before)
                return
            left -= 1


class Watched:
    """``ready()`` of a polled wait that also hears the alarm: ``ready()`` first; where it is
    false, the alarm tested, and ``on_alarm()`` (which raises) if it came."""

    __slots__ = ("ready", "alarm", "on_alarm")

    def __init__(self, ready, alarm: Alarm, on_alarm):
        self.ready, self.alarm, self.on_alarm = ready, alarm, on_alarm

    def __call__(self) -> bool:
        if self.ready():
            return True
        if self.alarm.test() is not None:
            self.on_alarm()
        return False


def ready_or_heard(requests, alarm: Alarm | None, on_alarm):
    """``ready()`` of a polled wait for ``requests`` (:func:`.._waiting.tested`) that also
    hears ``alarm`` (:class:`Watched`), where there is one."""
    ready = tested(requests)
    return ready if alarm is None else Watched(ready, alarm, on_alarm)

