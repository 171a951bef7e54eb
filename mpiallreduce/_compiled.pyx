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

from mpi4py import MPI

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
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


def install(dict last, dict calls, call_key, plain_timeout):
    """Hand this module the call cache (``_state.LAST``, ``_state.CALLS``) and the helpers of
    :mod:`._plans` it shares with the Python form (called once, by ``_plans``)."""
    global _LAST, _CALLS, _call_key, _plain_timeout
    _LAST, _CALLS, _call_key, _plain_timeout = last, calls, call_key, plain_timeout


def install_api(bind, reproducible_allreduce):
    """Hand :func:`allreduce` ``api._bind`` and ``reproducible.allreduce`` (called by ``api``)."""
    global _bind_allreduce, _reproducible_allreduce
    _bind_allreduce, _reproducible_allreduce = bind, reproducible_allreduce


def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
              check=True, timeout=None, reproducible=False, **params):
    """The compiled :func:`mpiallreduce.api.allreduce` (its docstring is set by ``api``)."""
    if reproducible:
        return _reproducible_allreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                       timeout, params)
    return _cached_call(None, _bind_allreduce, sendbuf, recvbuf, op, comm, algorithm, topology,
                        check, timeout, params)


cdef object _comm_allreduce = None
cdef object _unviewable = None
cdef object _settle = None


def install_comm(python_allreduce, unviewable, settle):
    """Hand :func:`comm_allreduce` the Python ``Comm.Allreduce`` (every call it does not take)
    and what that method does where a buffer is unviewable (called once, by ``comm``)."""
    global _comm_allreduce, _unviewable, _settle
    _comm_allreduce, _unviewable, _settle = python_allreduce, unviewable, settle


def comm_allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
    """The compiled ``mar.Comm.Allreduce``: its first branch (the objects of an earlier call
    routed as they came, found by ``recvbuf``'s identity), written as the Python method's;
    every other call is the Python method's."""
    cdef object entry = self._calls.get(id(recvbuf))
    if entry is not None and (<tuple>entry)[1] is recvbuf and (<tuple>entry)[0] is sendbuf \
            and (<tuple>entry)[2] is op and dtype_of(recvbuf) is (<tuple>entry)[3] \
            and (<tuple>entry)[4] == self.handle and not self._params:
        try:
            _cached_call(None, _bind_allreduce, sendbuf, recvbuf, op, (<tuple>entry)[5],
                         (<tuple>entry)[6], (<tuple>entry)[7], (<tuple>entry)[8],
                         (<tuple>entry)[9], {})
        except _unviewable as agreed:
            _settle(agreed, None)
            return self._mpi("Allreduce", sendbuf, recvbuf, op)
        return None
    return _comm_allreduce(self, sendbuf, recvbuf, op)


def cached_call(kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
                dict params):
    """The compiled :func:`._plans.cached_call`."""
    return _cached_call(kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                        timeout, params)


cdef object _cached_call(kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                         timeout, dict params):
    cdef object slot, entry, objects, direct
    cdef BoundFields e
    cdef type kind_of_timeout
    if comm is None:
        comm = _WORLD
    if timeout is not None:
        kind_of_timeout = type(timeout)
        if kind_of_timeout is not int and kind_of_timeout is not float:
            timeout = _plain_timeout(timeout)
    slot = id(recvbuf) if kind is None else (kind, id(recvbuf))
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
                and (timeout is None or ((type(timeout) is int or type(timeout) is float)
                                         and timeout > 0)):
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
    return bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params)


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
    ``divisor`` where it is not 0 (float64 AVG only: float32 runs pass 0)."""
    cdef Py_ssize_t i, q
    cdef real total
    for i in range(count):
        total = (<real *>slots[0])[i]
        for q in range(1, nranks):
            if product:
                total = total * (<real *>slots[q])[i]
            else:
                total = total + (<real *>slots[q])[i]
        if divisor != 0.0:
            total = <real>(total / divisor)
        out[i] = total


cdef class SmallRun:
    """The small regime's run of one shm plan, with or without a timeout (``timed``):
    the compiled ``direct``/``_timed`` of the Python form.

    Built from what the plan has bound (:meth:`from_plan` reads nothing else): the node, the
    source and result arrays, every rank's slot of each parity, the signature words and digest
    of a run with and without a timeout, the peers' digest words, the Python form's
    ``(load, reduce)`` per parity, the plan's ``_arrive`` and ``_mismatch``.
    """

    cdef object node, arrive, mismatch, label, signatures, programs, keep, written, sync, words
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

    def __cinit__(self, node, source, result, slots, signed_words, peer_digests, programs, arrive,
                  mismatch, str label, reducer_name, bint average, bint timed):
        """``slots[parity][q]``: rank q's slot (flat array); ``signed_words[timed]``: (words,
        digest); ``peer_digests[parity]``: ((a peer's header, word index), ...);
        ``programs[parity]``: the Python form's (load, reduce). Where the node's ranks outnumber
        the cores (``node.spin`` is 0) the wait yields at once."""
        cdef Py_ssize_t q, parity
        self.node, self.arrive, self.mismatch, self.label = node, arrive, mismatch, label
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

    def __call__(self, timeout=None):
        self.run(timeout)

    cdef int run(self, timeout) except -1:
        cdef object node = self.node
        cdef int64_t epoch, target
        cdef Py_ssize_t parity, q
        cdef double deadline = 0.0
        cdef bint arrived
        if self.timed:
            deadline = monotonic() + timeout
        epoch = node.epoch + 1
        node.epoch = epoch
        try:
            if node.finished != epoch - 1:
                node.turn(epoch, deadline if self.timed else None, self.label)
            parity = epoch & 1
            if self.reduce_kind == REDUCE_PYTHON:
                self.programs[parity][0]()
            else:
                memcpy(self.slots[parity][self.rank], self.source, self.nbytes)
            if self.written[parity] is not self.words:
                memcpy(self.header + self.lo[parity], words_of(self.words),
                       len(self.words) * sizeof(int64_t))
                self.written[parity] = self.words
            if self.sync is not None:
                self.sync()
            mar_store_release(self.header, 2 * epoch)  # arrived
            target = 2 * epoch - 1
            arrived = self.spin(target, deadline)
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
            else:
                self.reduce(parity)
        finally:
            node.finished = epoch
        return 0

    cdef bint spin(self, int64_t target, double deadline) noexcept:
        """Wait until every peer's counter reaches ``target``: spin (``spins`` pauses), then
        yield the core (and the GIL, as ``os.sched_yield`` does) between reads for up to
        :data:`YIELD_SECONDS` (or to the deadline); False if some peer is still missing then."""
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
                elif now - started > YIELD_SECONDS or (self.timed and now > deadline):
                    return False
                with nogil:
                    sched_yield()
        return True

    cdef void reduce(self, Py_ssize_t parity) noexcept nogil:
        """The result, every rank's slot combined in rank order (:func:`combine`)."""
        cdef bint product = self.reduce_kind == PROD_F64 or self.reduce_kind == PROD_F32
        if self.reduce_kind == SUM_F64 or self.reduce_kind == PROD_F64:
            combine(<double *>self.result, self.slots[parity], self.count, self.nranks,
                    product, self.divisor)
        else:
            combine(<float *>self.result, self.slots[parity], self.count, self.nranks,
                    product, self.divisor)
