"""The native rules export: its files follow each library's grammar, and the library reads them.

Serial tests: the MPI ones start their own 2-rank jobs (the library reads its rules file once, at
MPI initialisation) and read back which algorithm ran from a functional signature, explained in
:data:`SIGNATURE_WORKER`.
"""

import io
import json
import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

from mpiallreduce import native_rules, tune

ROOT = pathlib.Path(__file__).resolve().parent.parent
MPICH_PYTHON = ROOT / ".venv-mpich" / "bin" / "python"

#: Run under mpirun: Allreduce of ``count`` int64 with a commutative user op (an add) that records
#: the element count of every call it gets; rank 0 prints one JSON list per count of every rank's
#: calls. The algorithm decides who combines how much, deterministically: at 2 ranks and count 8,
#: recursive doubling combines all 8 on both ranks ([[8], [8]], both libraries' default here),
#: linear reduces all 8 on the root only ([[8], []]), ring combines one half on each rank
#: ([[4], [4]]). The sum is checked too, so a wrong result cannot pass as a signature.
SIGNATURE_WORKER = """
import json, sys
import numpy as np
from mpi4py import MPI
calls = []
def add(inbuf, inoutbuf, datatype):
    y = np.frombuffer(inoutbuf, dtype=np.int64)
    calls.append(len(y))
    y += np.frombuffer(inbuf, dtype=np.int64)
op = MPI.Op.Create(add, commute=True)
comm = MPI.COMM_WORLD
found = []
for count in map(int, sys.argv[1:]):
    calls.clear()
    x = np.arange(count, dtype=np.int64) + comm.rank
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=op)
    expected = sum(np.arange(count, dtype=np.int64) + r for r in range(comm.size))
    assert np.array_equal(out, expected), (out, expected)
    found.append(comm.gather(list(calls)))
if comm.rank == 0:
    print("SIGNATURE " + json.dumps(found))
"""

DEFAULT, LINEAR, RING = [[8], [8]], [[8], []], [[4], [4]]


def sweep(library: str, chosen: dict[int, str], configs: dict[str, dict], ranks: int = 2):
    """A native_sweep.py --json file whose strongest configuration per size is ``chosen``."""
    return {"library": library, "ranks": ranks, "repeats": 1, "configs": configs,
            "results": {"out": {str(size): {"native_config": label}
                                for size, label in chosen.items()}}}


OMPI = {"default": {},
        "tuned 1": {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                    "OMPI_MCA_coll_tuned_allreduce_algorithm": "1"},
        "tuned 4": {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"},
        "tuned 5": {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                    "OMPI_MCA_coll_tuned_allreduce_algorithm": "5",
                    "OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize": "262144"}}


# -- the writer and the grammar ---------------------------------------------------------------------


def test_ranges_split_at_the_geometric_midpoint_and_merge_equal_neighbours():
    assert native_rules.ranges([(8, "a"), (128, "b"), (2048, "b"), (1 << 20, "a")]) == [
        (0, 32, "a"), (33, 46340, "b"), (46341, None, "a")]
    assert native_rules.ranges([(64, "a")]) == [(0, None, "a")]
    with pytest.raises(native_rules.RulesError):
        native_rules.ranges([])


def test_openmpi_rules_follow_coll_tuned_grammar():
    data = sweep("Open MPI v5.0.11", {8: "default", 64 << 10: "tuned 4", 8 << 20: "tuned 5",
                                      64 << 20: "tuned 5"}, OMPI)
    text = native_rules.export("openmpi-rules", data, allow_reordering=True)
    rules = native_rules.parse_openmpi_rules(text)
    assert list(rules) == [native_rules.OPEN_MPI_ALLREDUCE] == [2]
    # the measured ranks get the choice; from 3 ranks up the built-in decision (algorithm 0)
    assert rules[2] == {2: [(0, 0, 0, 0), (725, 4, 0, 0), (741456, 5, 0, 262144)],
                        3: [(0, 0, 0, 0)]}
    # by default ring and segmented ring, which Open MPI would also run for non-commutative
    # ops, give way to the built-in decision, which checks the op
    safe = native_rules.parse_openmpi_rules(native_rules.export("openmpi-rules", data))
    assert safe[2] == {2: [(0, 0, 0, 0)], 3: [(0, 0, 0, 0)]}


@pytest.mark.parametrize("text, problem", [
    ("1\n2\n1\n2\n1\n8 4 0 0\n", "first message size must be 0"),
    ("1\n2\n1\n2\n2\n0 4 0 0\n", "ends where msg_size"),
    ("1\n2\n1\n2\n1\n0 ring 0 0\n", "algorithm must be an integer"),
    ("1\n2\n1\n2\n1\n0 4 0 0\n7\n", "unexpected '7'"),
])
def test_the_grammar_check_rejects_what_coll_tuned_would_ignore(text, problem):
    with pytest.raises(native_rules.RulesError, match=problem):
        native_rules.parse_openmpi_rules(text)


def test_export_refuses_a_sweep_without_configs_or_of_the_other_library():
    data = sweep("Open MPI v5.0.11", {8: "tuned 4"}, OMPI)
    with pytest.raises(native_rules.RulesError, match="native_sweep.py --json"):
        native_rules.export("openmpi-rules", {k: v for k, v in data.items() if k != "configs"})
    with pytest.raises(native_rules.RulesError, match="sweep under MPICH"):
        native_rules.export("mpich-json", data, builtin={})
    with pytest.raises(native_rules.RulesError, match="known: openmpi-rules, mpich-json"):
        native_rules.export("nccl", data)


MPICH_BUILTIN = {"collective=bcast": {"comm_type=intra": {"algorithm=MPIR_Bcast_intra_binomial": {}}},
                 "collective=allreduce": {
                     "comm_type=intra": {"algorithm=MPIR_Allreduce_intra_recursive_doubling": {}},
                     "comm_type=inter": {"algorithm=MPIR_Allreduce_inter_reduce_exchange_bcast": {}}}}


def test_mpich_tree_replaces_only_allreduce_intra_at_the_measured_size():
    mpich = {"default": {}, "mpich ring": {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}}
    data = sweep("MPICH Version: 5.0.2", {8: "default", 128: "mpich ring"}, mpich, ranks=4)
    tree = json.loads(native_rules.export("mpich-json", data, builtin=MPICH_BUILTIN))
    default = MPICH_BUILTIN["collective=allreduce"]["comm_type=intra"]
    assert tree["collective=bcast"] == MPICH_BUILTIN["collective=bcast"]
    allreduce = tree["collective=allreduce"]
    assert allreduce["comm_type=inter"] == MPICH_BUILTIN["collective=allreduce"]["comm_type=inter"]
    assert list(allreduce["comm_type=intra"]) == ["comm_size<4", "comm_size<=4", "comm_size=any"]
    assert allreduce["comm_type=intra"]["comm_size<4"] == default
    assert allreduce["comm_type=intra"]["comm_size=any"] == default
    assert allreduce["comm_type=intra"]["comm_size<=4"] == {
        "avg_msg_size<=32": default,
        "avg_msg_size=any": {"is_op_built_in=yes": {
            "count<pow2": default,
            "count=any": {"algorithm=MPIR_Allreduce_intra_ring": {}}},
            "is_op_built_in=no": default}}


def test_tune_export_writes_the_file_from_a_sweep(tmp_path):
    source = tmp_path / "sweep.json"
    source.write_text(json.dumps(sweep("Open MPI v5.0.11", {8: "tuned 1", 1024: "tuned 4"}, OMPI)))
    target = tmp_path / "rules.txt"
    out = io.StringIO()
    assert tune.main(["--export", "openmpi-rules", "--from", str(source), "--output",
                      str(target)], out=out) == 0
    assert f"wrote openmpi-rules to {target}" in out.getvalue()
    assert native_rules.parse_openmpi_rules(target.read_text())[2][2] == [(0, 1, 0, 0),
                                                                          (91, 0, 0, 0)]
    assert tune.main(["--export", "openmpi-rules", "--from", str(source), "--output",
                      str(target), "--allow-reordering"], out=out) == 0
    assert native_rules.parse_openmpi_rules(target.read_text())[2][2] == [(0, 1, 0, 0),
                                                                          (91, 4, 0, 0)]
    assert tune.main(["--export", "openmpi-rules", "--from", str(tmp_path / "none.json")],
                     out=out) == 2


# -- the libraries read them ----------------------------------------------------------------------


def signature(python, env: dict, counts=(8,)) -> list:
    """Run SIGNATURE_WORKER on 2 ranks under ``python``'s mpirun; return its signatures."""
    mpirun = pathlib.Path(python).parent / "mpirun"
    result = subprocess.run(["timeout", "100", str(mpirun), "-n", "2", str(python), "-c",
                             SIGNATURE_WORKER, *map(str, counts)],
                            env={**launcher_environment(), "OMPI_MCA_osc": "^ucx", **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("SIGNATURE "))
    return json.loads(line.split(" ", 1)[1])


def _open_mpi() -> bool:
    return MPIRUN.exists() and "Open MPI" in subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True, text=True, env=launcher_environment(), timeout=60).stdout


needs_open_mpi = pytest.mark.skipif(not _open_mpi(), reason="mpi4py does not run on Open MPI")


def _rules_env(path) -> dict:
    return {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
            "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(path)}


@needs_mpirun
@needs_open_mpi
def test_open_mpi_follows_the_exported_rules_per_message_size(tmp_path):
    """Open MPI runs what the file names, per size, and ignores a malformed file.

    Without a file, count 8 runs recursive doubling (DEFAULT). A file choosing linear up to 90
    bytes and ring above gives LINEAR at 64 bytes and ring's halves at 256 bytes in the same job; swapped,
    it gives the swapped signatures, so neither can come from the built-in decision or by
    accident. coll/tuned rejects a malformed file without a word (its messages are compiled
    only into debug builds): the same rules with the zero-size rule missing give DEFAULT back.
    """
    assert signature(sys.executable, {}, (8, 32)) == [DEFAULT, [[32], [32]]]
    for below, above in (("tuned 1", "tuned 4"), ("tuned 4", "tuned 1")):
        path = tmp_path / f"{below}.rules"
        path.write_text(native_rules.export("openmpi-rules", sweep(
            "Open MPI v5.0.11", {8: below, 1024: above}, OMPI), allow_reordering=True))
        expected = {"tuned 1": LINEAR, "tuned 4": RING}
        halves = {"tuned 1": [[32], []], "tuned 4": [[16], [16]]}
        assert signature(sys.executable, _rules_env(path), (8, 32)) == [
            expected[below], halves[above]]
    broken = path.read_text().replace("\n0 4 0 0", "\n8 4 0 0")
    with pytest.raises(native_rules.RulesError, match="first message size must be 0"):
        native_rules.parse_openmpi_rules(broken)
    (tmp_path / "broken.rules").write_text(broken)
    assert signature(sys.executable, _rules_env(tmp_path / "broken.rules"), (8, 32)) == [
        DEFAULT, [[32], [32]]]


@pytest.mark.skipif(not MPICH_PYTHON.exists(), reason="no .venv-mpich")
def test_mpich_reads_the_exported_tree_and_keeps_user_ops_on_the_default(tmp_path):
    """MPICH runs with the exported tree (its own built-in tree, allreduce's intra branch
    replaced by ring at 2 ranks), and the file is what decides.

    The measured branch holds for built-in ops only (MPICH's reduce_scatter_allgather asserts
    a built-in op), which the user-op signature cannot observe: the user op keeps the default
    (DEFAULT). The same file with allreduce's intra branch naming ring for every op gives RING,
    so MPICH reads the file's allreduce branch rather than its built-in tree.
    """
    # the module alone (not the package, whose compiled part is built for Open MPI's venv)
    builtin = json.loads(subprocess.run(
        [str(MPICH_PYTHON), "-c", "import importlib.util, json, sys; spec = importlib.util."
         "spec_from_file_location('rules', sys.argv[1]); rules = importlib.util."
         "module_from_spec(spec); spec.loader.exec_module(rules); "
         "print(json.dumps(rules.mpich_builtin_tree()))", native_rules.__file__],
        capture_output=True, text=True, env=launcher_environment(), timeout=60,
        check=True).stdout)
    mpich = {"default": {}, "mpich ring": {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}}
    path = tmp_path / "tree.json"
    path.write_text(native_rules.export("mpich-json", sweep("MPICH Version: 5.0.2",
                                                            {8: "mpich ring"}, mpich),
                                        builtin=builtin))
    env = {"MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE": str(path)}
    assert signature(MPICH_PYTHON, env, (8,)) == [DEFAULT]
    forced = json.loads(path.read_text())
    forced["collective=allreduce"]["comm_type=intra"] = {
        "algorithm=MPIR_Allreduce_intra_ring": {}}
    path.write_text(json.dumps(forced))
    assert signature(MPICH_PYTHON, env, (8,)) == [RING]
