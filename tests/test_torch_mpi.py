"""PyTorch on mpiallreduce, with real torch and Gloo: the DDP hooks give Gloo's results (PyTorch's
own hooks run over Gloo are the reference), DDP trains alike with Gloo and with the hook, and
torch tensors go wherever NumPy arrays go. Skipped where torch is not installed (``make
test-torch`` builds .venv-torch and runs these at -n 1 2 3 4)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_on_every_rank, load_file
from mpi4py import MPI

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

import mpiallreduce as mar  # noqa: E402 - after the skip
from mpiallreduce import torch as mart  # noqa: E402

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
#: every dtype DDP reduces gradients in
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
#: bucket sizes in elements: one, odd, DDP's first bucket (1 MiB of float32), 64 MiB of float32
COUNTS = [1, 1001, 1 << 18, 16 << 20]


@pytest.fixture(scope="module", autouse=True)
def gloo():
    if not dist.is_initialized():
        mart.init_process_group(WORLD)
    yield


@pytest.fixture
def state():
    state = mart.State(WORLD, abort_on_error=False)
    yield state
    state.free()


def _contribution(count, dtype, exact, seed=0):
    """This rank's bucket: integers times p (so dividing by p then summing is exact in any
    order) or random values."""
    g = torch.Generator().manual_seed(1000 * seed + WORLD.rank)
    if exact:
        x = torch.randint(-4, 5, (count,), generator=g, dtype=torch.int64) * WORLD.size
        return x.to(dtype)
    x = torch.randn(count, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        x = x + 1j * torch.randn(count, generator=g, dtype=torch.float64)
    return x.to(dtype)


#: unit roundoff of the 16-bit types (their sums round each partial sum)
ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _compare(out, ref, exact, wire=None):
    """Why ``out`` is not ``ref`` on this rank: bit for bit where the order of the sum cannot
    matter (exact inputs, or two ranks: a + b), else within p roundings of the partial sums
    (|x| < 4 here) in the type that travels (``wire``, default ``out``'s)."""
    if exact or WORLD.size <= 2:
        same = torch.equal(out, ref)
    else:
        tol = 4 * WORLD.size * ROUNDOFF.get(wire or out.dtype, 2.0 ** -20)
        same = torch.allclose(out.to(torch.complex128 if out.is_complex() else torch.float64),
                              ref.to(torch.complex128 if ref.is_complex() else torch.float64),
                              rtol=tol, atol=tol)
    if same:
        return None
    bad = (out != ref).nonzero()
    return f"rank {WORLD.rank}: {bad.numel()} elements differ, first {bad[0].tolist()}"


def _run_hook(hook, state, count, dtype, exact, index=0):
    x = _contribution(count, dtype, exact)
    ours = hook(state, mart.Bucket(index, x.clone())).wait()
    theirs = {mart.allreduce_hook: default_hooks.allreduce_hook,
              mart.fp16_compress_hook: default_hooks.fp16_compress_hook,
              mart.bf16_compress_hook: default_hooks.bf16_compress_hook}[hook](
        None, mart.Bucket(index, x.clone())).wait()
    if isinstance(theirs, list):
        theirs = theirs[0]
    if ours.is_complex() and not theirs.is_complex():  # Gloo reduces complex as real pairs
        theirs = torch.view_as_complex(theirs)
    return ours, theirs


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", COUNTS[:3])
def test_allreduce_hook_equals_gloo(state, count, dtype, exact):
    ours, theirs = _run_hook(mart.allreduce_hook, state, count, dtype, exact)
    assert_on_every_rank(WORLD, _compare(ours, theirs, exact), ours.view(torch.uint8).numpy())


@pytest.mark.parametrize("algorithm", ["shm", "ring", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("count", [1001, 1 << 18])
def test_the_division_folded_into_the_sum_keeps_divide_then_sums_bits(algorithm, dtype, count):
    """Where p is a power of two the hook divides the sum (mar.AVG, no pass of its own over the
    bucket): bit for bit the sum of the divided values by the same algorithm, for values
    spanning 2^-100..2^100 (neither subnormal once divided nor overflowing)."""
    comm = WORLD.Dup()
    if mar.Topology.from_comm(comm).nnodes > 1 and algorithm == "shm":
        algorithm = "ring"  # simulated nodes: shm refuses
    g = torch.Generator().manual_seed(WORLD.rank)
    x = (torch.randn(count, generator=g, dtype=torch.float64)
         * 2.0 ** torch.randint(-100, 101, (count,), generator=g)).to(dtype)
    state = mart.State(comm, algorithm=algorithm, abort_on_error=False)
    try:
        ours = mart.allreduce_hook(state, mart.Bucket(0, x.clone())).wait()
        folded = state._reductions["allreduce", 0].folded
    finally:
        state.free()
    ref = x.div(comm.size).numpy()
    mar.allreduce(MPI.IN_PLACE, ref, comm=comm, algorithm=algorithm)
    comm.Free()
    problem = None
    if folded != (WORLD.size & (WORLD.size - 1) == 0):
        problem = f"folded {folded} at p = {WORLD.size}"
    elif not torch.equal(ours, torch.from_numpy(ref)):
        problem = f"rank {WORLD.rank}: {(ours != torch.from_numpy(ref)).sum()} elements differ"
    assert_on_every_rank(WORLD, problem)


def test_allreduce_hook_64_mib_bucket(state):
    ours, theirs = _run_hook(mart.allreduce_hook, state, COUNTS[-1], torch.float32, exact=True)
    assert_on_every_rank(WORLD, _compare(ours, theirs, True))


@pytest.mark.parametrize("hook", [mart.fp16_compress_hook, mart.bf16_compress_hook],
                         ids=lambda h: h.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
def test_compress_hooks_equal_pytorchs(state, hook, dtype, exact):
    ours, theirs = _run_hook(hook, state, 1001, dtype, exact)
    assert ours.dtype == dtype
    wire = torch.float16 if hook is mart.fp16_compress_hook else torch.bfloat16
    assert_on_every_rank(WORLD, _compare(ours, theirs, exact, wire),
                         ours.view(torch.uint8).numpy())


@pytest.mark.parametrize("algorithm", ["auto", "ring", "native"])
def test_buckets_in_flight_together_and_rebuilt(algorithm):
    """Several buckets queued before any wait complete each with its own result (a schedule's
    or MPI's requests in flight together; shm's complete at their start); a bucket index whose
    buffer changes (DDP rebuilds buckets after its first step) binds again."""
    state = mart.State(WORLD, algorithm=algorithm, abort_on_error=False)
    try:
        _in_flight_and_rebuilt(state)
    finally:
        state.free()


def _in_flight_and_rebuilt(state):
    buffers = [_contribution(n, torch.float32, True, seed=i) for i, n in enumerate((5, 7, 300))]
    futures = [mart.allreduce_hook(state, mart.Bucket(i, b.clone())) for i, b in enumerate(buffers)]
    problems = []
    for future, x in zip(futures, buffers):
        ref = x.div(WORLD.size)
        dist.all_reduce(ref)
        problems.append(_compare(future.wait(), ref, True))
    rebuilt = _contribution(11, torch.float32, True, seed=9)
    ref = rebuilt.div(WORLD.size)
    dist.all_reduce(ref)
    problems.append(_compare(mart.allreduce_hook(state, mart.Bucket(0, rebuilt.clone())).wait(), ref,
                             True))
    assert_on_every_rank(WORLD, "; ".join(p for p in problems if p) or None)


@pytest.mark.parametrize("hook", [mart.allreduce_hook, mart.bf16_compress_hook],
                         ids=lambda h: h.__name__)
def test_buckets_reduced_step_after_step_each_equal_gloo(state, hook):
    """DDP's pattern: the same buckets (same memory, new gradients) reduced every step, two in
    flight before either is waited for. Each step's results equal Gloo's: a result held in the
    state's memory (the node's shared window) is neither overwritten by the other bucket's
    reduction nor stale from the previous step's."""
    buffers = [torch.empty(n) for n in (1 << 18, 3001)]
    problems = []
    for step in range(3):
        inputs = [_contribution(b.numel(), torch.float32, False, seed=10 * step + i)
                  for i, b in enumerate(buffers)]
        for buffer, x in zip(buffers, inputs):
            buffer.copy_(x)
        futures = [hook(state, mart.Bucket(i, b)) for i, b in enumerate(buffers)]
        results = [f.wait().clone() for f in futures]
        for i, (x, ours) in enumerate(zip(inputs, results)):
            theirs = {mart.allreduce_hook: default_hooks.allreduce_hook,
                      mart.bf16_compress_hook: default_hooks.bf16_compress_hook}[hook](
                None, mart.Bucket(i, x.clone())).wait()
            wire = torch.bfloat16 if hook is mart.bf16_compress_hook else None
            problem = _compare(ours, theirs, False, wire)
            if problem:
                problems.append(f"step {step}, bucket {i}: {problem}")
    assert_on_every_rank(WORLD, "; ".join(problems) or None)


def test_topk_hook_with_every_entry_is_the_average_and_keeps_no_residual():
    state = mart.State(WORLD, topk=mar.TopK(1.0), abort_on_error=False)
    try:
        x = _contribution(1001, torch.float32, True)
        out = mart.topk_hook(state, mart.Bucket(0, x.clone())).wait()
        ref = x.clone()
        dist.all_reduce(ref)
        ref /= WORLD.size
        residual = state.topk.residuals[0]
        assert_on_every_rank(WORLD, _compare(out, ref, True) or (
            None if not residual.any() else f"rank {WORLD.rank}: residual left"))
    finally:
        state.free()


def test_topk_hook_error_feedback_loses_nothing():
    """Over steps, the applied averages plus the residuals' average equal the exact average."""
    state = mart.State(WORLD, topk=mar.TopK(0.1), abort_on_error=False)
    try:
        applied = torch.zeros(200, dtype=torch.float64)
        total = torch.zeros(200, dtype=torch.float64)
        for step in range(4):
            x = _contribution(200, torch.float64, True, seed=step)
            total += x
            applied += mart.topk_hook(state, mart.Bucket(0, x.clone())).wait()
        left = torch.from_numpy(state.topk.residuals[0].copy())
        dist.all_reduce(left)
        dist.all_reduce(total)
        problem = _compare(applied + left / WORLD.size, total / WORLD.size, True)
        assert_on_every_rank(WORLD, problem)
    finally:
        state.free()


def test_a_mismatched_bucket_fails_on_every_rank_with_a_clear_error(state):
    count = 10 + WORLD.rank if WORLD.size > 1 else 10
    future = mart.allreduce_hook(state, mart.Bucket(0, torch.ones(count)))
    if WORLD.size == 1:
        future.wait()
        return
    with pytest.raises(Exception, match="differ|mismatch"):
        future.wait()
    # later buckets get the same error at once, on every rank
    with pytest.raises(Exception, match="differ|mismatch"):
        mart.allreduce_hook(state, mart.Bucket(1, torch.ones(3))).wait()


def test_the_state_must_be_a_state():
    with pytest.raises(TypeError, match="mar.torch.State"):
        mart.allreduce_hook(None, mart.Bucket(0, torch.ones(3)))


def test_init_process_group_matches_the_communicator():
    assert (dist.get_rank(), dist.get_world_size()) == (WORLD.rank, WORLD.size)
    with pytest.raises(RuntimeError, match="already initialised"):
        mart.init_process_group(WORLD)


# -- DDP, end to end ---------------------------------------------------------------------------------

def _train(dtype, hook, steps=3, view=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 5)).to(dtype)
    # small buckets, so that the model's gradients make several; ``view``: the gradients are
    # views of the buckets, which the hook reduces in place (DDP copies nothing back)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005,
                                                    gradient_as_bucket_view=view)
    state = None
    if hook is not None:
        state = mart.State(WORLD, abort_on_error=False)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(WORLD.rank)
    for _ in range(steps):
        x = torch.randint(-2, 3, (16, 33), generator=g).to(dtype)
        loss = ddp(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if state is not None:
        state.free()
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket-views"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ddp_with_the_hook_trains_as_ddp_with_gloo(dtype, view):
    ours, theirs = _train(dtype, mart.allreduce_hook, view=view), _train(dtype, None, view=view)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    problem = None
    if not torch.allclose(ours, theirs, rtol=tol, atol=tol):
        problem = f"rank {WORLD.rank}: max difference {(ours - theirs).abs().max().item()}"
    elif WORLD.size <= 2 and dtype != torch.bfloat16 and not torch.equal(ours, theirs):
        problem = f"rank {WORLD.rank}: not bit for bit at p = {WORLD.size}"
    assert_on_every_rank(WORLD, problem, ours.numpy())


# -- torch tensors wherever NumPy arrays go -----------------------------------------------------------

def _reference(x):
    ref = np.empty_like(x.numpy())
    WORLD.Allreduce(x.numpy(), ref, MPI.SUM)
    return ref


def test_tensors_in_every_entry_point():
    x = _contribution(1001, torch.float64, True)
    ref = _reference(x)
    results = {"allreduce": mar.allreduce(x)}
    out = torch.empty_like(x)
    mar.allreduce(x, out)
    results["allreduce into a tensor"] = out.numpy()
    inplace = x.clone()
    mar.allreduce(MPI.IN_PLACE, inplace)
    results["in place"] = inplace.numpy()
    with mar.plan(x, torch.empty_like(x)) as plan:
        results["plan"] = plan.run()
    results["iallreduce"] = mar.iallreduce(x, torch.empty_like(x)).wait()
    comm = mar.Comm(WORLD)
    comm_out = torch.empty_like(x)
    comm.Allreduce(x, comm_out)
    results["mar.Comm"] = comm_out.numpy()
    grads = [x.clone(), x[:10].clone()]
    with mar.GradSync(grads, WORLD, op=MPI.SUM) as sync:
        sync.synchronize()
    results["GradSync"] = grads[0].numpy()
    problems = [f"rank {WORLD.rank}: {name} differs" for name, result in results.items()
                if not np.array_equal(np.asarray(result), ref)]
    assert_on_every_rank(WORLD, "; ".join(problems) or None)


@pytest.mark.parametrize("tensor, error, words", [
    (lambda: torch.ones(4, 4)[:, :2], ValueError, "contiguous()"),
    (lambda: torch.ones(3, requires_grad=True), TypeError, "detach()"),
    (lambda: torch.ones(3, dtype=torch.bfloat16), TypeError, "float()"),
    (lambda: torch.ones(3, device="meta"), TypeError, "cpu()"),
], ids=["strided", "requires_grad", "bfloat16", "not_cpu"])
def test_tensors_mpi_cannot_read_are_refused_with_the_fix(tensor, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        mar.allreduce(tensor())
    with pytest.raises((TypeError, ValueError), match=r"detach\(\)|contiguous\(\)|float\(\)|cpu\(\)"):
        mar.GradSync([tensor()], WORLD)


def test_the_example_trains_alike_three_ways(capsys):
    module = load_file("examples/torch_ddp.py", "torch_ddp")
    assert module.main(["--inputs", "32", "--hidden", "64", "--steps", "4"]) == 0
    if WORLD.rank == 0:
        assert capsys.readouterr().out.rstrip().endswith("within the tolerances: True")


def test_the_bench_takes_gloo_as_its_reference_column(capsys):
    from mpiallreduce import bench

    status = bench.main(["--against", "gloo", "--sizes", "8,4K", "--algorithms", "ring,auto",
                         "--iterations", "3", "--in-place"])
    assert status == bench.EXIT_OK
    if WORLD.rank == 0:
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
        assert [r[1] for r in rows[:4]] == ["gloo", "native", "ring", "auto"], out
        assert all(r[-1] == "ok" for r in rows) and "vs_gloo" in out
        assert {r[7] for r in rows if r[1] == "gloo"} == {"1.00"}
