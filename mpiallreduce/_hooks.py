"""The transport's hooks: what the layers above it plug into it, declared here and set only
through the functions below (never by assigning attributes of the transport's classes).

- **tracer**: the recorder of a trace (:class:`.tracing.Recorder`) or None. A plan bound while
  one is registered binds a traced run: a schedule's :class:`.executor.Plan` runs
  ``tracer.program(plan, steps)`` instead of its plain flat program; a plan without a schedule
  (native, shm, node phases) binds its run with ``tracer.marks(plan, transport, regime)``.
  Read once, when a plan is bound: an untraced plan never looks at it again, so a run costs
  nothing for it. Set by :mod:`.tracing`.
- **starter**: ``start(plan, timeout) -> Request``, what ``Plan.start()`` calls to start a run
  without waiting for it. Set by :mod:`.nonblocking` (which owns progress) when it is
  imported, as ``import mpiallreduce`` does.

This module imports nothing; the transport reads ``_hooks.tracer`` and ``_hooks.starter``.
"""

from __future__ import annotations

#: the registered trace recorder, or None (tracing off): see the module docstring.
tracer = None

#: ``start(plan, timeout) -> Request``, or None until :mod:`.nonblocking` is imported.
starter = None


def register_tracer(recorder) -> None:
    """Trace every plan bound from now on with ``recorder``; ValueError if a trace is on."""
    global tracer
    if tracer is not None:
        raise ValueError(f"tracing is already on (to {tracer.path}); one trace at a time")
    tracer = recorder


def unregister_tracer(recorder) -> None:
    """Stop tracing new plans with ``recorder`` (nothing if another one, or none, is on)."""
    global tracer
    if tracer is recorder:
        tracer = None


def set_starter(start) -> None:
    """Make ``start(plan, timeout) -> Request`` what ``Plan.start()`` calls."""
    global starter
    starter = start
