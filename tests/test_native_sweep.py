"""scripts/native_sweep.py: the configurations it forces, its summary, and one tiny real run."""

import json
import pathlib
import subprocess
import sys

from conftest import launcher_environment, load_file, needs_mpirun

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "native_sweep.py"
sweep = load_file("scripts/native_sweep.py", "native_sweep")


def test_open_mpi_configurations_force_each_tuned_algorithm_and_segment():
    chosen = sweep.configs("Open MPI v5.0.11")
    assert chosen["default"] == {}
    algos = sorted({env.get("OMPI_MCA_coll_tuned_allreduce_algorithm") for env in chosen.values()}
                   - {None})
    assert algos == ["4", "5", "6"]
    segments = sorted(int(env["OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize"])
                      for env in chosen.values()
                      if "OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize" in env)
    assert segments == [262144, 1048576, 4194304]
    assert all(env.get("OMPI_MCA_coll_tuned_use_dynamic_rules") == "1"
               for label, env in chosen.items() if label != "default")


def test_mpich_choices_appear_only_under_mpich():
    assert not any("MPIR_CVAR" in str(env) for env in sweep.configs("Open MPI v5").values())
    mpich = sweep.configs("MPICH Version: 4.2.0")
    assert {env["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] for label, env in mpich.items()
            if label != "default"} == set(sweep.MPICH_CHOICES)


def _row(size, algorithm, avg, check="ok"):
    return {"size": size, "algorithm": algorithm, "avg_us": avg, "check": check}


def test_summary_takes_the_strongest_native_and_our_best_of_the_same_runs():
    runs = {
        "default": [[_row(8, "native", 10), _row(8, "tree", 12)],
                    [_row(8, "native", 14), _row(8, "tree", 11)]],
        "tuned 4": [[_row(8, "native", 6), _row(8, "tree", 9), _row(8, "ring", 7, "FAIL"),
                     _row(8, "auto", 6.3)]],
    }
    summary = sweep.summarise(runs)[8]
    assert summary["native_config"] == "tuned 4" and summary["native_us"] == 6
    # a failed row never wins, and auto (native itself below its crossover) is not one of ours
    assert summary["ours"] == "tree" and summary["ours_us"] == 9
    assert summary["default_native_us"] == 12  # median of 10 and 14
    assert summary["auto_vs_native"] == {"tuned 4": 6.3 / 6}
    line = sweep.table({"out": {8: summary}}, {8: 2.5})[1]
    assert line.split() == ["8", "out", "tuned", "4", "6.0", "tree", "9.0", "1.50", "0.75",
                            "2.5", "1.05"]


@needs_mpirun
def test_a_tiny_sweep_runs_every_configuration_and_prints_the_table(tmp_path):
    out = tmp_path / "sweep.json"
    result = subprocess.run(
        ["timeout", "280", sys.executable, str(SCRIPT), "--sizes", "8", "--repeats", "1",
         "--modes", "in_place", "--json", str(out), "--timeout", "120", "--",
         "--iterations", "2", "--algorithms", "tree,knomial"],
        env=launcher_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "strongest native" in result.stdout
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and set(data["floor_us"]) == {"8"}
    row = data["results"]["in_place"]["8"]
    assert row["ours"] in ("tree", "knomial") and len(row["natives_us"]) == len(sweep.configs(
        data["library"]))
