# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled form of the call path's per-call part and of shm's small regime.

Each function here is the twin of a Python one, written the same way, and must give the same
results bit for bit and raise the same errors (the suite runs both forms; ``_form`` picks one):

- :func:`cached_call` is :func:`._plans.cached_call` (the cache hit test, the agreement of a
  repeated call, dispatch to the bound run);
- :func:`allreduce` is :func:`.api.allreduce` (the entry point, so that nothing between the
  caller's call and the run is a Python frame);
- :class:`SmallRun` is the small regime's bound run (``_bind_direct``'s closures in the shm
  package): load, sign, publish, the spin-then-yield wait, the comparison of the peers'
  digests, the reduce of a few float elements and the copy out. Its slow paths (an earlier
  epoch still running, a peer not there after the spin, differing signatures, other ops and
  dtypes) call the Python methods the Python form calls.

Memory ordering: the counter is a release store after the data and signature, a peer's counter
an acquire load before its data (correct on any CPU; the fence ``sync`` of the Python form is
called as well where it is set, so both forms can share a node).
"""

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_CheckSignals, PyErr_Clear
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_FromSize_t, PyLong_FromVoidPtr
from cpython.dict cimport PyDict_GetItemWithError
from cpython.ref cimport PyObject
from cpython.object cimport PyObject_GenericGetDict

from collections import OrderedDict

from mpi4py import MPI

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int nanosleep(const timespec *req, timespec *rem)
    int CLOCK_MONOTONIC

cdef extern from *:
    """
    #include <stdint.h>
    static inline int64_t mar_load_acquire(const int64_t *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void mar_store_release(int64_t *p, int64_t v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    static inline void mar_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield" ::: "memory");
    #else
        __asm__ __volatile__("" ::: "memory");
    #endif
    }
    """
    int64_t mar_load_acquire(const int64_t *p) nogil
    void mar_store_release(int64_t *p, int64_t v) nogil
    void mar_pause() nogil


cdef inline double monotonic() noexcept nogil:
    """time.monotonic(): CLOCK_MONOTONIC on Linux."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# -- the one wait loop (twin of _waiting.wait_until) ---------------------------------------------

cdef Py_ssize_t _BUSY_TESTS = 64
cdef double _SPIN_SECONDS = 2e-3


def install_waiting(Py_ssize_t busy_tests, double spin_seconds):
    """Hand :func:`wait_until` the defaults of ``_waiting`` (called once, by ``_waiting``)."""
    global _BUSY_TESTS, _SPIN_SECONDS
    _BUSY_TESTS, _SPIN_SECONDS = busy_tests, spin_seconds


cdef int pause_for(double seconds) except -1:
    """Sleep ``seconds`` without the GIL, as ``time.sleep`` does, then run the signal handlers
    (a Ctrl-C during a wait raises, as it does in the Python form)."""
    cdef timespec ts
    ts.tv_sec = <time_t>seconds
    ts.tv_nsec = <long>((seconds - ts.tv_sec) * 1e9)
    with nogil:
        nanosleep(&ts, NULL)
    return PyErr_CheckSignals()


def wait_until(ready, deadline, on_timeout=None, *, spin=None, yield_seconds=None):
    """The compiled :func:`._waiting.wait_until` (its docstring says what it does): the same
    calls of ``ready()`` at the same pace, with no generator or Python frame of its own between
    them (a poll of MPI requests, ``EachTested`` or ``partial(Testall, requests)``, runs no
    bytecode at all)."""
    if wait(ready, deadline, _BUSY_TESTS if spin is None else spin,
            _SPIN_SECONDS if yield_seconds is None else yield_seconds):
        return True
    if on_timeout is not None:
        on_timeout()
        raise AssertionError("on_timeout() must raise")
    return False


cdef bint wait(ready, deadline, Py_ssize_t spins, double yielding) except -1:
    """:func:`wait_until`'s loop: whether ``ready()`` turned true by ``deadline`` (None: it
    waits forever)."""
    cdef Py_ssize_t i
    cdef bint forever = deadline is None
    cdef double limit = 0.0 if forever else deadline
    cdef double now, until, pause = 5e-5
    for i in range(spins):
        if ready():
            return True
    now = monotonic()
    if yielding > 0:
        until = now + yielding
        if not forever and limit < until:
            until = limit
        while now < until:
            with nogil:
                sched_yield()
            PyErr_CheckSignals()
            if ready():
                return True
            now = monotonic()
    while forever or now <= limit:
        pause_for(pause)
        pause = min(pause * 2, 1e-3)
        if ready():
            return True
        now = monotonic()
    return bool(ready())


cdef class PolledStep:
    """Twin of ``partial(plan._poll_step, ready, requests, bound)`` (``executor.Plan``): a step's
    wait in a run with a deadline, ``ready()`` to the plan's ``_deadline``, else
    ``plan.expire(requests, bound, plan._timeout)``, with no Python frame of its own."""

    cdef object plan, ready, requests, bound

    def __init__(self, plan, ready, requests, bound):
        self.plan, self.ready, self.requests, self.bound = plan, ready, requests, bound

    def __call__(self):
        cdef dict fields = <dict>PyObject_GenericGetDict(self.plan, NULL)
        if not wait(self.ready, fields["_deadline"], _BUSY_TESTS, _SPIN_SECONDS):
            self.plan.expire(self.requests, self.bound, fields["_timeout"])


cdef class EachTested:
    """Twin of :class:`._waiting.EachTested` (its docstring says what it does)."""

    cdef tuple tests
    cdef Py_ssize_t done

    def __init__(self, requests):
        self.tests = tuple([request.Test for request in reversed(requests)])
        self.done = 0

    def __call__(self):
        cdef Py_ssize_t done = self.done, count = len(self.tests)
        while done < count:
            if not self.tests[done]():
                self.done = done
                return False
            done += 1
        self.done = 0
        return True


# -- the call path (twin of _plans.cached_call) -----------------------------------------------------

cnp.import_array()


cdef class BoundFields:
    """The fields of ``_plans.BoundCall`` that :func:`cached_call` reads on every call, as C
    struct members (``BoundCall`` derives from this class in the compiled form; the Python
    form keeps them in ``__slots__``). Their meaning: ``_plans.BoundCall``."""

    cdef public object state, objects, algorithm, params, dtype, in_place, signatures, nbytes
    cdef public object fused, direct, args, timed, result


cdef inline bint same_shape(a, b):
    """``a.shape == b.shape`` for two NumPy arrays."""
    cdef int ndim = cnp.PyArray_NDIM(<cnp.ndarray>a), axis
    if ndim != cnp.PyArray_NDIM(<cnp.ndarray>b):
        return False
    for axis in range(ndim):
        if cnp.PyArray_DIMS(<cnp.ndarray>a)[axis] != cnp.PyArray_DIMS(<cnp.ndarray>b)[axis]:
            return False
    return True


cdef inline object dtype_of(array):
    """``array.dtype``, read from the struct where ``array`` is a NumPy array."""
    if cnp.PyArray_Check(array):
        return <object>cnp.PyArray_DESCR(<cnp.ndarray>array)
    return array.dtype


cdef object _WORLD = MPI.COMM_WORLD
cdef dict _LAST = None
cdef dict _CALLS = None
cdef object _call_key = None
cdef object _plain_timeout = None
cdef object _bind_allreduce = None
cdef object _reproducible_allreduce = None
cdef object _reproducible_iallreduce = None


cdef dict _SHAPES = None
cdef Py_ssize_t _STAGE_BYTES = 0

cdef enum:  # the entry points' numbers in a call's slot (``_plans.ALLREDUCE``, ...)
    ALLREDUCE = 0
    IALLREDUCE = 1


def install(dict last, dict calls, call_key, plain_timeout, dict shapes, Py_ssize_t stage_bytes,
            tuple kinds):
    """Hand this module the call cache (``_state.LAST``, ``_state.CALLS``, ``_state.SHAPES``)
    and the helpers of :mod:`._plans` it shares with the Python form (called once, by
    ``_plans``). ``kinds``: ``_plans``' (ALLREDUCE, IALLREDUCE), which must be this module's."""
    global _LAST, _CALLS, _call_key, _plain_timeout, _SHAPES, _STAGE_BYTES
    if kinds != (ALLREDUCE, IALLREDUCE):
        raise ImportError(f"_plans numbers the entry points {kinds}, this build "
                          f"{(ALLREDUCE, IALLREDUCE)}: rebuild the extension")
    _LAST, _CALLS, _call_key, _plain_timeout = last, calls, call_key, plain_timeout
    _SHAPES, _STAGE_BYTES = shapes, stage_bytes


def install_api(bind, reproducible_allreduce, reproducible_iallreduce):
    """Hand :func:`allreduce` and :func:`iallreduce` ``api._bind``, ``reproducible.allreduce``
    and ``reproducible.iallreduce`` (called by ``api``)."""
    global _bind_allreduce, _reproducible_allreduce, _reproducible_iallreduce
    _bind_allreduce, _reproducible_allreduce = bind, reproducible_allreduce
    _reproducible_iallreduce = reproducible_iallreduce


def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
              check=True, timeout=None, reproducible=False, **params):
    """The compiled :func:`mpiallreduce.api.allreduce` (its docstring is set by ``api``)."""
    if reproducible:
        return _reproducible_allreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                       timeout, params)
    return _cached_call(ALLREDUCE, _bind_allreduce, sendbuf, recvbuf, op, comm, algorithm,
                        topology, check, timeout, params)


# -- the non-blocking entry points (twins of nonblocking.iallreduce, start and Request.wait) -----

cdef class RequestFields:
    """The fields of ``nonblocking.Request`` as C members, and its ``wait`` where the request is
    complete (the one an shm run returns: whole at the start): the result, or its error.
    Any other wait is the Python method's (``Request._wait``). Their meaning:
    ``nonblocking.requests.Request``."""

    cdef public object _result, _work, _finish, _error

    def wait(self, timeout=None):
        """Wait for completion and return the result array (``timeout``: seconds, then
        :class:`CollectiveTimeout` with the request still in flight): the compiled
        ``nonblocking.Request.wait``, whose docstring says more."""
        if self._work is None:
            if self._error is not None:
                raise self._error
            return self._result
        return self._wait(timeout)


cdef object _python_start = None
cdef object _MISSING = object()
cdef type _ORDERED = OrderedDict
cdef object _bind_iallreduce = None
cdef list _DROPPED = None
cdef object _tidy = None


def install_nonblocking(python_start, bind, list dropped, tidy):
    """Hand :func:`iallreduce` and :func:`start` the Python ``start`` (every start it does not
    take), ``nonblocking.calls._bind`` and the list of native requests dropped in flight with
    its tidier (called once, by ``nonblocking.calls``)."""
    global _python_start, _bind_iallreduce, _DROPPED, _tidy
    _python_start, _bind_iallreduce, _DROPPED, _tidy = python_start, bind, dropped, tidy


def iallreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
               check=True, timeout=None, reproducible=False, **params):
    """The compiled :func:`mpiallreduce.api.iallreduce` (its docstring is set by ``api``)."""
    if reproducible:
        return _reproducible_iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                        timeout, params)
    if _DROPPED:
        _tidy()
    return _cached_call(IALLREDUCE, _bind_iallreduce, sendbuf, recvbuf, op, comm, algorithm,
                        topology, check, timeout, params)


def start(plan, timeout=None):
    """The compiled :func:`.nonblocking.start`: its branch for an shm plan of the small regime
    started again without deadline (runs whole now; the same complete request every start),
    with the checks of ``ShmPlan.run``; every other start is the Python function's."""
    cdef object direct, done, node, state
    cdef dict fields
    if timeout is None:
        # the plan's attributes read from its instance dict (a missing one: the Python start),
        # which is cheaper here than a generic attribute lookup per field
        fields = PyObject_GenericGetDict(plan, NULL)
        direct = fields.get("direct")
        if type(direct) is SmallRun and fields.get("timeout", _MISSING) is None \
                and not fields.get("_freed", True) and not fields.get("_broken", True):
            state, node, done = fields.get("_state"), fields.get("_node"), fields.get("_done")
            if state is not None and not state.broken and node is not None \
                    and not node.closed and isinstance(done, RequestFields) \
                    and (<RequestFields>done)._result is fields.get("recvbuf", _MISSING):
                (<SmallRun>direct).run(None)
                return done
    return _python_start(plan, timeout)


cdef object _comm_allreduce = None
cdef object _unviewable = None
cdef object _settle = None


cdef dict _DTYPE_OF = None
cdef object _IN_PLACE = MPI.IN_PLACE
cdef type _DATATYPE = MPI.Datatype


def install_comm(python_allreduce, unviewable, settle, dict dtype_of_handle):
    """Hand :func:`comm_allreduce` the Python ``Comm.Allreduce`` (every call it does not take),
    what that method does where a buffer is unviewable, and ``_buffers``' table of the
    datatypes it reduces (handle -> NumPy dtype; called once, by ``comm``)."""
    global _comm_allreduce, _unviewable, _settle, _DTYPE_OF
    _comm_allreduce, _unviewable, _settle = python_allreduce, unviewable, settle
    _DTYPE_OF = dtype_of_handle


def comm_allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
    """The compiled ``mar.Comm.Allreduce``: its first branch (the objects of an earlier call
    routed as they came, found by ``recvbuf``'s identity), written as the Python method's;
    every other call is the Python method's."""
    # the communicator's fields read from its instance dict (cheaper than a generic attribute
    # lookup each; a missing one: the Python method)
    cdef dict fields = PyObject_GenericGetDict(self, NULL)
    cdef object calls = fields.get("_calls"), params = fields.get("_params", _MISSING)
    cdef object args = fields.get("_args"), entry = None
    if type(calls) is not _ORDERED or type(args) is not tuple or params is _MISSING:
        return _comm_allreduce(self, sendbuf, recvbuf, op)
    entry = dict_get(calls, id_of(recvbuf))
    if entry is not None and (<tuple>entry)[1] is recvbuf and (<tuple>entry)[0] is sendbuf \
            and (<tuple>entry)[2] is op and dtype_of(recvbuf) is (<tuple>entry)[3] \
            and (<tuple>entry)[4] == self and not params:
        try:
            _cached_call(ALLREDUCE, _bind_allreduce, sendbuf, recvbuf, op, (<tuple>entry)[4],
                         (<tuple>entry)[5], (<tuple>entry)[6], (<tuple>entry)[7],
                         (<tuple>entry)[8], {})
        except _unviewable as agreed:
            _settle(agreed, None)
            return self._mpi("Allreduce", sendbuf, recvbuf, op)
        return None
    if not params and (<tuple>args)[3] is None \
            and _comm_by_shape(self, fields, sendbuf, recvbuf, op):
        return None
    return _comm_allreduce(self, sendbuf, recvbuf, op)


cdef inline object id_of(obj):
    """``id(obj)``, without a call of the builtin."""
    return PyLong_FromVoidPtr(<void *>obj)


cdef inline object dict_get(mapping, key):
    """``mapping.get(key)`` for a dict or an OrderedDict (whose items live in the dict itself),
    without a method call."""
    cdef PyObject *found = PyDict_GetItemWithError(mapping, key)  # (an error raises here)
    return None if found == NULL else <object>found


cdef bint _comm_by_shape(self, dict fields, sendbuf, recvbuf, op) except -1:
    """The Python method's second branch (fresh arrays of a shape ``mar.allreduce`` knows,
    ``Comm._shapes``), where the shape runs on the caller's memory (:func:`run_shape`), and the
    same for a buffer spec ``[buffer, count, datatype]`` (as array libraries wrap their
    tensors, a new one per call). False: the Python method takes the call."""
    cdef bint in_place = sendbuf is _IN_PLACE
    cdef Py_buffer send_view, recv_view
    cdef object dtype, known, shape, previous
    cdef object shapes = fields.get("_shapes")
    cdef Py_ssize_t count, send_count = 0, nbytes
    cdef char *recv_at
    cdef const char *send_at
    if type(shapes) is not _ORDERED:
        return False
    if cnp.PyArray_CheckExact(recvbuf):
        known = dict_get(shapes, (id_of(dtype_of(recvbuf)),
                                  cnp.PyArray_SIZE(<cnp.ndarray>recvbuf), in_place, id_of(op)))
        if known is None or not fresh_pair(sendbuf, recvbuf, in_place):
            return False
        shape = _live_shape(self, known, op)
        if shape is None:
            return False
        previous = fields.get("_previous")
        if type(previous) is not list:
            return False
        if (<list>previous)[1] is recvbuf and (<list>previous)[0] is sendbuf:
            return False  # the same arrays again: the Python method binds them
        (<list>previous)[0] = sendbuf
        (<list>previous)[1] = recvbuf
        run_shape(shape, sendbuf, recvbuf)
        return True
    if not (type(recvbuf) is list or type(recvbuf) is tuple):
        return False
    dtype = spec_of(recvbuf, &count)
    if dtype is None or count == 0:
        return False
    if not in_place and (not (type(sendbuf) is list or type(sendbuf) is tuple)
                         or spec_of(sendbuf, &send_count) is not dtype or send_count != count):
        return False
    known = dict_get(shapes, (id_of(dtype), count, in_place, id_of(op)))
    if known is None:
        return False
    shape = _live_shape(self, known, op)
    if shape is None:
        return False
    nbytes = count * (<cnp.dtype>dtype).itemsize
    if PyObject_GetBuffer((<tuple>recvbuf)[0] if type(recvbuf) is tuple else (<list>recvbuf)[0],
                          &recv_view, PyBUF_WRITABLE) < 0:
        PyErr_Clear()
        return False
    try:
        if recv_view.len < nbytes:
            return False
        recv_at = <char *>recv_view.buf
        if in_place:
            (<SmallRun>shape.small).run_at(None, recv_at, recv_at)
            return True
        if PyObject_GetBuffer(sendbuf[0], &send_view, PyBUF_SIMPLE) < 0:
            PyErr_Clear()
            return False
        try:
            send_at = <const char *>send_view.buf
            if send_view.len < nbytes or (send_at < recv_at + nbytes and recv_at < send_at + nbytes):
                return False
            (<SmallRun>shape.small).run_at(None, send_at, recv_at)
            return True
        finally:
            PyBuffer_Release(&send_view)
    finally:
        PyBuffer_Release(&recv_view)


cdef object _live_shape(self, known, op):
    """The shape of a ``Comm._shapes`` entry if it still runs on the caller's memory here."""
    shape = (<tuple>known)[0]
    if not shape.live or (<tuple>known)[1] is not op or not (<tuple>known)[2] == self:
        return None
    if shape.small is None:
        return None
    return shape


cdef object spec_of(spec, Py_ssize_t *count):
    """The NumPy dtype of an mpi4py spec ``[buffer, count, datatype]`` (count a plain int, a
    predefined datatype :mod:`._buffers` reduces), with its count; None for any other spec
    (the Python method parses those)."""
    cdef object datatype, number, dtype
    if len(spec) != 3:
        return None
    number, datatype = spec[1], spec[2]
    if type(number) is not int or type(datatype) is not _DATATYPE:
        return None
    dtype = _DTYPE_OF.get(datatype.handle)
    if dtype is None or number < 0:
        return None
    count[0] = number
    return dtype


def cached_call(Py_ssize_t kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                timeout, dict params):
    """The compiled :func:`._plans.cached_call`."""
    return _cached_call(kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                        timeout, params)


cdef object _cached_call(Py_ssize_t kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology,
                         check, timeout, dict params):
    cdef object slot, entry, objects, direct
    cdef BoundFields e
    cdef type kind_of_timeout
    if comm is None:
        comm = _WORLD
    if timeout is not None:
        kind_of_timeout = type(timeout)
        if kind_of_timeout is not int and kind_of_timeout is not float:
            timeout = _plain_timeout(timeout)
    slot = PyLong_FromSize_t(<size_t><void *>recvbuf + kind)  # id(recvbuf) + kind
    entry = _LAST.get(slot)  # the entry last bound to recvbuf, verified object by object
    if entry is not None:
        e = <BoundFields?>entry
        objects = e.objects
        if (<tuple>objects)[1] is not sendbuf or (<tuple>objects)[3] is not op \
                or (<tuple>objects)[0] is not comm or (<tuple>objects)[4] is not topology \
                or (e.algorithm is not algorithm and e.algorithm != algorithm) \
                or ((e.params or params) and e.params != params):
            entry = _CALLS.get(_call_key(slot, comm, sendbuf, op, algorithm, topology, params))
            if entry is None:
                return bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                            timeout, params)
            e = <BoundFields?>entry
        # (see _plans.cached_call: equal ids are the same objects while the entry holds them)
        if dtype_of(recvbuf) is e.dtype \
                and (e.in_place or (dtype_of(sendbuf) is e.dtype
                                    and (same_shape(sendbuf, recvbuf)
                                         if cnp.PyArray_Check(sendbuf)
                                         and cnp.PyArray_Check(recvbuf)
                                         else sendbuf.shape == recvbuf.shape))) \
                and (timeout is None or positive_seconds(timeout)):
            if check and not e.fused:  # a fused entry's run checks the arguments itself
                entry.agree(timeout)
            if timeout is None:
                direct = e.direct
                if direct is not None:
                    if type(direct) is SmallRun:
                        (<SmallRun>direct).run(None)
                    else:
                        direct(*e.args)
                    return e.result
            elif e.timed is not None:  # (the timeout checked above)
                direct = e.timed
                if type(direct) is SmallRun:
                    (<SmallRun>direct).run(timeout)
                else:
                    direct(timeout)
                return e.result
            return entry.run(timeout)
    elif kind == ALLREDUCE and timeout is None:
        entry = _by_shape(sendbuf, recvbuf, op, comm, algorithm, topology, params)
        if entry is not None:
            return entry
    return bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params)


cdef inline bint positive_seconds(timeout) except -1:
    """``timeout`` (not None) is a plain positive number of seconds (an int or a float, not a
    bool: ``_waiting.check_timeout`` words the refusal of anything else)."""
    if type(timeout) is float:
        return PyFloat_AS_DOUBLE(timeout) > 0.0
    return type(timeout) is int and timeout > 0


cdef object _by_shape(sendbuf, recvbuf, op, comm, algorithm, topology, dict params):
    """A call with fresh arrays (or a result left to mpiallreduce) that a shape in
    ``_state.SHAPES`` runs on the caller's memory (:func:`run_shape`): ``api._bind``'s first
    branch where the shape's run is compiled; its result, or None (``bind`` takes the call)."""
    cdef bint in_place = sendbuf is _IN_PLACE
    cdef object shape, key, held, like = recvbuf
    if recvbuf is None:
        like = sendbuf  # (the result will be made like it)
        if in_place or not cnp.PyArray_CheckExact(sendbuf) \
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>sendbuf) \
                or cnp.PyArray_NBYTES(<cnp.ndarray>sendbuf) > _STAGE_BYTES:
            return None
    elif not cnp.PyArray_CheckExact(recvbuf):
        return None
    # _plans.shape_key, written out: (ids of comm, op; algorithm; ids of topology, dtype; count,
    # in place, parameters)
    key = (id_of(comm), id_of(op), algorithm, id_of(topology), id_of(dtype_of(like)),
           cnp.PyArray_SIZE(<cnp.ndarray>like), in_place, tuple(params.items()) if params else ())
    try:
        shape = _SHAPES.get(key)
    except TypeError:  # a parameter value that cannot be hashed (bind says what it says)
        return None
    if shape is None or shape.small is None:
        return None
    if recvbuf is not None:
        # the arrays of the previous call again: bound to them (``bind``), as in the Python form
        # (``Shape.repeats``, whose weak references are read once, when this path takes over)
        held = shape.held
        if held is not None:
            if (<tuple>held)[1] is recvbuf and (<tuple>held)[0] is sendbuf:
                shape.held = None
                shape.remember(sendbuf, recvbuf)
                return None
        elif shape.previous is not None:
            if shape.repeats(sendbuf, recvbuf):
                return None
            shape.previous = None
    if recvbuf is None:  # np.empty_like(sendbuf), as api._bind makes it
        # (the key matched a dtype mpiallreduce reduces: a built-in one, native byte order)
        recvbuf = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(<cnp.ndarray>sendbuf),
                                    cnp.PyArray_DIMS(<cnp.ndarray>sendbuf),
                                    cnp.PyArray_TYPE(<cnp.ndarray>sendbuf), 0)
    elif not fresh_pair(sendbuf, recvbuf, in_place):
        return None
    else:
        shape.held = (sendbuf, recvbuf)
    run_shape(shape, sendbuf, recvbuf)
    return recvbuf


cdef bint fresh_pair(sendbuf, recvbuf, bint in_place) except -1:
    """:func:`._plans.fresh_arrays` for a NumPy ``recvbuf`` whose dtype and size a shape's key
    matched: C-contiguous and writable, and ``sendbuf`` in place or a NumPy array of the same
    dtype and shape, C-contiguous, not overlapping it (their memory bounds, as
    ``np.may_share_memory`` compares them)."""
    cdef int flags = cnp.PyArray_FLAGS(<cnp.ndarray>recvbuf)
    cdef char *send_at
    cdef char *recv_at
    cdef Py_ssize_t nbytes
    if not (flags & cnp.NPY_ARRAY_C_CONTIGUOUS) or not (flags & cnp.NPY_ARRAY_WRITEABLE):
        return False
    if in_place:
        return True
    if not cnp.PyArray_CheckExact(sendbuf) or dtype_of(sendbuf) is not dtype_of(recvbuf) \
            or not same_shape(sendbuf, recvbuf) \
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>sendbuf):
        return False
    send_at = cnp.PyArray_BYTES(<cnp.ndarray>sendbuf)
    recv_at = cnp.PyArray_BYTES(<cnp.ndarray>recvbuf)
    nbytes = cnp.PyArray_NBYTES(<cnp.ndarray>recvbuf)
    return not (send_at < recv_at + nbytes and recv_at < send_at + nbytes)


cdef int run_shape(shape, sendbuf, recvbuf) except -1:
    """Run ``shape`` (a ``_plans.Shape`` whose ``small`` is set: a compiled small-regime shm
    run, whose run checks the arguments itself) on the caller's arrays, checked by
    :func:`fresh_pair`: no staging copies."""
    cdef char *recv_at = cnp.PyArray_BYTES(<cnp.ndarray>recvbuf)
    cdef const char *send_at = recv_at if sendbuf is _IN_PLACE \
        else cnp.PyArray_BYTES(<cnp.ndarray>sendbuf)
    return (<SmallRun>shape.small).run_at(None, send_at, recv_at)


# -- shm's small regime ---------------------------------------------------------------------------

cdef enum:  # the reduces done here; any other is the Python form's bound reduce
    REDUCE_PYTHON, SUM_F64, PROD_F64, SUM_F32, PROD_F32

#: pauses a wait spins through before it yields the core (none where ranks outnumber cores: a
#: spinning rank then holds the core its peer needs to arrive)
cdef int SPIN_PAUSES = 2000
#: seconds a wait yields the core between reads before it hands over to the Python form's wait
#: (which goes on yielding, then sleeps, to the deadline, and words a timeout)
cdef double YIELD_SECONDS = 10e-3

cdef size_t address(array) except 0:
    cdef size_t at = array.__array_interface__["data"][0]
    if at == 0:
        raise ValueError("an shm slot or buffer without memory")
    return at


cdef int64_t *words_of(view) except NULL:
    """The first int64 of a header memoryview (format 'q') or of an int64 array."""
    cdef const int64_t[::1] words = view
    return <int64_t *>&words[0]


ctypedef fused real:
    float
    double


cdef inline void combine(real *out, char **slots, Py_ssize_t count, Py_ssize_t nranks,
                         bint product, double divisor) noexcept nogil:
    """``out[i] = s0[i] op s1[i] op ...`` in rank order, element by element, as the Python
    form's ufunc calls (``out = s0 + s1; out = out + s2; ...``) or scalar loop; then divided by
    ``divisor`` where it is not 0 (float64 AVG only: float32 runs pass 0).

    One pass per rank, as the ufuncs make: each is a loop of one operation the compiler
    vectorizes, whose loads of a peer's slot (lines another core just wrote) overlap. The
    element-by-element form (all ranks' values of ``i``, then ``i + 1``) lost to NumPy's
    calls from 1 KiB at 2 ranks: its loads of the peers' slots do not overlap."""
    cdef Py_ssize_t i, q
    cdef real *theirs = <real *>slots[0]
    cdef real *mine
    if nranks == 1:
        for i in range(count):
            out[i] = theirs[i]
    else:
        for q in range(1, nranks):
            mine = out if q > 1 else theirs
            theirs = <real *>slots[q]
            if product:
                for i in range(count):
                    out[i] = mine[i] * theirs[i]
            else:
                for i in range(count):
                    out[i] = mine[i] + theirs[i]
    if divisor != 0.0:
        for i in range(count):
            out[i] = <real>(out[i] / divisor)


#: pieces of a load in ``shm.plan.copy_call``'s slow band (``shm.plan.trapped``: the target 1-63
#: bytes past the source modulo 4096, where glibc's ``rep movsb`` runs several times slower):
#: a memcpy below glibc's threshold for it (2 KiB with 16-byte vectors, 4 KiB with 32) takes
#: its vector loop, which the band does not slow (a 32 KiB load 16 bytes past runs many times
#: faster in 1 KiB pieces than whole)
cdef Py_ssize_t PIECE_BYTES = 1024


cdef inline void load(char *target, const char *source, Py_ssize_t nbytes,
                      Py_ssize_t loop_bytes, Py_ssize_t trapped) noexcept nogil:
    """memcpy, in :data:`PIECE_BYTES` pieces where ``copy_call`` would take its loop (from
    ``loop_bytes``, the target 1 to ``trapped`` - 1 bytes past the source modulo 4096)."""
    cdef Py_ssize_t distance = <Py_ssize_t>((<size_t>target - <size_t>source) & 4095)
    cdef Py_ssize_t at = 0
    if nbytes < loop_bytes or distance == 0 or distance >= trapped:
        memcpy(target, source, nbytes)
        return
    while at < nbytes:
        memcpy(target + at, source + at, min(PIECE_BYTES, nbytes - at))
        at += PIECE_BYTES


cdef class NodeFields:
    """The fields of ``shm.node.Node`` that every small-regime run reads and writes, as C
    members (the compiled form's ``Node`` derives from this class): ``epoch``, the last epoch
    claimed, and ``finished``, the last one run to its end on this rank (``Node`` says more)."""

    cdef public int64_t epoch, finished


cdef class SmallRun:
    """The small regime's run of one shm plan, with or without a timeout (``timed``):
    the compiled ``direct``/``_timed`` of the Python form.

    Built from what the plan has bound (:meth:`from_plan` reads nothing else): the node, the
    source and result arrays, every rank's slot of each parity, the signature words and digest
    of a run with and without a timeout, the peers' digest words, the Python form's
    ``(load, reduce)`` per parity, the plan's ``_arrive`` and ``_mismatch``, and, bound while
    tracing, the stamps of its phases.
    """

    cdef object node, arrive, mismatch, label, signatures, programs, keep, sync, words, stamps
    cdef NodeFields fields
    cdef list written
    cdef int64_t *header
    cdef int64_t *peers[64]
    cdef int64_t *digests[2][64]
    cdef char *slots[2][64]
    cdef char *source
    cdef char *result
    cdef Py_ssize_t npeers, nranks, rank, count, nbytes
    cdef Py_ssize_t lo[2]
    cdef int64_t mine
    cdef int reduce_kind, timed, spins
    cdef double divisor
    cdef Py_ssize_t loop_bytes, trapped

    def __cinit__(self, node, source, result, slots, signed_words, peer_digests, programs, arrive,
                  mismatch, str label, reducer_name, bint average, bint timed, stamps=None):
        """``slots[parity][q]``: rank q's slot (flat array); ``signed_words[timed]``: (words,
        digest); ``peer_digests[parity]``: ((a peer's header, word index), ...);
        ``programs[parity]``: the Python form's (load, reduce). Where the node's ranks outnumber
        the cores (``node.spin`` is 0) the wait yields at once. ``stamps``: a traced plan's
        clock readings that open its phases run, arrive, wait, reduce and end (argument-free
        calls, :meth:`.tracing.Marks.stamps`), made where the Python form's programs make them
        (which hold them where the reduce is theirs); None untraced."""
        cdef Py_ssize_t q, parity
        self.node, self.arrive, self.mismatch, self.label = node, arrive, mismatch, label
        self.fields = <NodeFields?>node
        self.timed = timed
        self.nranks, self.rank = node.size, node.rank
        if self.nranks > 64:
            raise ValueError("the compiled small regime takes up to 64 ranks per node")
        self.npeers = len(node.peer_headers)
        self.header = words_of(node.header)
        for q in range(self.npeers):
            self.peers[q] = words_of(node.peer_headers[q])
        self.words, self.mine = signed_words[timed]
        self.written, self.sync = node.written, node.sync
        self.signatures = tuple(node.signatures[parity] for parity in (0, 1))
        self.programs = tuple(programs)
        for parity in range(2):
            self.lo[parity] = node.areas[parity][0]
            for q, (theirs, word) in enumerate(peer_digests[parity]):
                self.digests[parity][q] = words_of(theirs) + <Py_ssize_t>word
            for q in range(self.nranks):
                self.slots[parity][q] = <char *>address(slots[parity][q])
        self.source = <char *>address(source)
        self.result = <char *>address(result)
        self.count, self.nbytes = result.size, result.nbytes
        self.keep = (source, result, slots, peer_digests, node.header, node.peer_headers)
        self.reduce_kind = REDUCE_PYTHON
        self.divisor = 0.0
        dtype = result.dtype.char
        if reducer_name in ("SUM", "AVG") and dtype == "d":
            self.reduce_kind = SUM_F64
            if average:
                self.divisor = <double>self.nranks
        elif reducer_name == "PROD" and dtype == "d":
            self.reduce_kind = PROD_F64
        elif reducer_name == "SUM" and dtype == "f":
            self.reduce_kind = SUM_F32
        elif reducer_name == "PROD" and dtype == "f":
            self.reduce_kind = PROD_F32
        self.spins = SPIN_PAUSES if node.spin else 0
        self.stamps = None if self.reduce_kind == REDUCE_PYTHON or stamps is None \
            else tuple(stamps)
        from .shm.plan import LOOP_COPY_BYTES, TRAPPED_DISTANCE
        self.loop_bytes, self.trapped = LOOP_COPY_BYTES, TRAPPED_DISTANCE

    def __call__(self, timeout=None):
        self.run(timeout)

    @property
    def takes_pointers(self) -> bool:
        """Whether :meth:`run_at` may run this plan on other memory than its own arrays (its
        load and reduce are compiled, not the Python form's calls bound to those arrays)."""
        return self.reduce_kind != REDUCE_PYTHON

    cdef inline int run(self, timeout) except -1:
        return self.run_at(timeout, self.source, self.result)

    cdef int run_at(self, timeout, const char *source, char *result) except -1:
        """The run, with ``source`` and ``result`` in place of the plan's own arrays (the
        same size and element type; they may be one array: in place). Only where
        :attr:`takes_pointers`; the caller checks the memory (:func:`run_shape`).

        A timed run reads the clock only where it waits: for its turn, or past the spin (a
        peer not there within it). Its deadline counts ``timeout`` from that reading, so it
        lies at most the spin's few microseconds past the Python form's (from the start of
        the run), and never before it."""
        cdef object node = self.node
        cdef NodeFields fields = self.fields
        cdef int64_t epoch, target
        cdef Py_ssize_t parity, q
        cdef double deadline = 0.0  # 0: not read yet (see above)
        cdef double seconds = timeout if self.timed else 0.0
        cdef bint arrived
        cdef object stamps = self.stamps
        epoch = fields.epoch + 1
        fields.epoch = epoch
        try:
            if fields.finished != epoch - 1:
                if self.timed:
                    deadline = monotonic() + seconds
                node.turn(epoch, deadline if self.timed else None, self.label)
            parity = epoch & 1
            if self.reduce_kind == REDUCE_PYTHON:
                self.programs[parity][0]()
            else:
                if stamps is not None:
                    (<tuple>stamps)[0]()
                    (<tuple>stamps)[1]()
                load(self.slots[parity][self.rank], source, self.nbytes, self.loop_bytes,
                     self.trapped)
                if stamps is not None:
                    (<tuple>stamps)[2]()
            if self.written[parity] is not self.words:
                memcpy(self.header + self.lo[parity], words_of(self.words),
                       len(self.words) * sizeof(int64_t))
                self.written[parity] = self.words
            if self.sync is not None:
                self.sync()
            mar_store_release(self.header, 2 * epoch)  # arrived
            target = 2 * epoch - 1
            arrived = self.spin(target, &deadline, seconds)
            if not arrived:  # the Python form's wait: to the deadline, naming who is missing
                self.arrive(node, epoch, 2 * epoch, timeout, deadline if self.timed else None, 0)
            else:
                if self.sync is not None:
                    self.sync()
                for q in range(self.npeers):
                    if mar_load_acquire(self.digests[parity][q]) != self.mine:
                        self.mismatch(self.signatures[parity], timeout)
            if self.reduce_kind == REDUCE_PYTHON:
                self.programs[parity][1]()
            elif stamps is None:
                self.reduce(parity, result)
            else:
                (<tuple>stamps)[3]()
                self.reduce(parity, result)
                (<tuple>stamps)[4]()
        except BaseException as error:  # a run left in the middle revokes (``_revoke``)
            node.give_up(error, self.label)
            raise
        finally:
            fields.finished = epoch
        return 0

    cdef bint spin(self, int64_t target, double *deadline, double seconds) noexcept:
        """Wait until every peer's counter reaches ``target``: spin (``spins`` pauses), then
        yield the core (and the GIL, as ``os.sched_yield`` does) between reads for up to
        :data:`YIELD_SECONDS` (or to ``deadline[0]``, ``seconds`` from the first yield where
        a timed run has not read it yet); False if some peer is still missing then."""
        cdef Py_ssize_t q
        cdef int spins = 0
        cdef double started = 0.0, now
        for q in range(self.npeers):
            while mar_load_acquire(self.peers[q]) < target:
                if spins < self.spins:
                    spins += 1
                    mar_pause()
                    continue
                now = monotonic()
                if started == 0.0:
                    started = now
                    if self.timed and deadline[0] == 0.0:
                        deadline[0] = now + seconds
                elif now - started > YIELD_SECONDS or (self.timed and now > deadline[0]):
                    return False
                with nogil:
                    sched_yield()
        return True

    cdef void reduce(self, Py_ssize_t parity, char *result) noexcept nogil:
        """The result, every rank's slot combined in rank order (:func:`combine`)."""
        cdef bint product = self.reduce_kind == PROD_F64 or self.reduce_kind == PROD_F32
        if self.reduce_kind == SUM_F64 or self.reduce_kind == PROD_F64:
            combine(<double *>result, self.slots[parity], self.count, self.nranks,
                    product, self.divisor)
        else:
            combine(<float *>result, self.slots[parity], self.count, self.nranks,
                    product, self.divisor)
