"""Non-blocking allreduce: ``iallreduce``, ``start(plan)`` and the :class:`Request` they return.

What runs where:

- **In the caller's thread, at the call**: the local checks, the agreement check (``check=True``)
  and binding the plan (a slot of tags of its own and scratch of its own: nothing a blocking
  call uses meanwhile). These are collective and happen in call order on every rank, as the
  ordering rule requires.
- **MPI's own collective** (``algorithm="native"``, and ``auto`` where it picks native): the
  request *is* MPI's, started at the call (``Iallreduce`` on a duplicate kept for non-blocking
  collectives; ``start`` of a native plan: the plan's persistent ``Allreduce_init`` request).
  ``test()``/``wait()`` call MPI's ``Test``/``Wait`` in the caller's thread; no thread is
  involved, so the call costs about what MPI's costs.
- **A schedule**: its run is a generator of steps (:meth:`~mpiallreduce.executor.Plan.steps`).
  The call posts the first step; every ``test()``, ``wait()`` and later start on the same
  communicator advances every run in flight there as far as it goes without blocking (a run
  never waits for a later one, so waits in any order complete). With ``MPI_THREAD_MULTIPLE``
  (mpi4py's default) one progress thread per communicator also advances them while the caller
  is elsewhere (computing, or blocked in another collective that a peer reaches only after
  waiting): it looks every :data:`GRACE_SECONDS` and advances the runs only once one of them
  has been in flight since its previous look (a caller that starts and waits in a loop never
  meets it), then polls at a backing-off pace (50 µs up to :data:`PAUSE_MAX`) while runs are
  in flight, never blocks in MPI and never spins against the caller's computation; it exits
  after :data:`IDLE_SECONDS` without runs. Whichever thread completes a step runs its
  combines; the engine's lock keeps them apart (the thread only tries it, so it never makes
  the caller wait). A started plan without deadline, and a repeated ``iallreduce`` of a
  schedule, post their first step from a flat program (:meth:`Plan.lean_program`; the
  ``iallreduce``'s posts fresh messages with the tags of the slot it takes); a wait with
  nothing else in flight runs the rest of that program, anything else first turns it into a
  stepwise run.
- **A repeated call** (``iallreduce`` with the same objects) finds its set-up in the
  communicator's call cache (:class:`_Started`).
- **A plan without steps of its own** (``reproducible=True``, the shared-memory transport) runs
  whole at ``start``/``iallreduce``, in call order as a blocking call would, and its request is
  complete on return (the same result, no overlap).
- **Deadlines and failures** are decided in the caller's thread: ``wait(timeout)`` raises
  :class:`CollectiveTimeout` and leaves the request in flight; a run past its own ``timeout=``
  (given to ``iallreduce``/``start``) is abandoned there, in the caller's thread, which marks
  the communicator unusable (so no other thread ever frees plans the caller may be running).

Below ``MPI_THREAD_MULTIPLE`` (``mpi4py.rc.thread_level``) there is no thread: schedules progress
only inside ``start``, ``test`` and ``wait``; wait for a request before a blocking call that a
peer may reach only after waiting for it.
"""

# the package's names as its importers use them (tests: threaded, _engine; docs: _bind, _Started)
from .calls import _bind, _Started, iallreduce, start  # noqa: F401
from .progress import _engine, threaded  # noqa: F401
from .requests import Request

__all__ = ["Request", "iallreduce", "start", "threaded"]
