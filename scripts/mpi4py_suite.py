"""Run mpi4py's own collective test modules through ``mar.Comm`` and compare with plain mpi4py.

mar.Comm is a drop-in for ``MPI.Intracomm``: mpi4py's test suite, written for mpi4py, is the
strictest user it has. This fetches the sdist of the installed mpi4py (``pip download``,
cached under ``.cache/mpi4py-suite``), and at each rank count runs the modules below once on
plain mpi4py and once per algorithm with ``MPI.COMM_WORLD``/``MPI.COMM_SELF`` replaced by
``mar.Comm(..., algorithm)`` (``scripts/mpi4py_suite_plugin.py``). A run passes when it ends
without a crash or a hang and every test passes exactly where plain mpi4py's passes, except
the refusals listed in ``scripts/mpi4py_suite_refusals.txt`` (each with its reason).

    python scripts/mpi4py_suite.py --venv .venv --ranks 1 2 3 [--only 1=ring,auto ...]

``--only N=ALG,ALG`` runs only those algorithms at -n N (plain mpi4py always runs).

Exit status 0 when every run passes; rank logs and JUnit files stay in ``.test-logs/mpi4py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("test_cco_buf", "test_cco_nb_buf", "test_cco_pr_buf", "test_cco_obj", "test_cco_vec",
           "test_cco_nb_vec", "test_cco_pr_vec", "test_msgspec", "test_op")
ALGORITHMS = ("ring", "recursive_doubling", "shm", "auto")
REFUSALS = Path(__file__).with_name("mpi4py_suite_refusals.txt")


def fetch(python: str, cache: Path) -> Path:
    """The ``test/`` folder of the installed mpi4py's sdist, downloaded once into ``cache``."""
    version = subprocess.run([python, "-c", "import mpi4py; print(mpi4py.__version__)"],
                             check=True, capture_output=True, text=True).stdout.strip()
    tests = cache / f"mpi4py-{version}" / "test"
    if (tests / "mpiunittest.py").exists():
        return tests
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"mpi4py-{version}.tar.gz"
    if not archive.exists():
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                        ":all:", f"mpi4py=={version}", "-d", str(cache)], check=True)
    with tarfile.open(archive) as sdist:
        members = [m for m in sdist.getmembers() if m.name.startswith(f"mpi4py-{version}/test/")]
        # the "data" filter (no links out, no devices) where tarfile has it: Python 3.12, and
        # 3.11 from 3.11.4 (Debian 12's 3.11.2 lacks it; the members are mpi4py's own tests)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        sdist.extractall(cache, members=members, **safe)
    return tests


def refusals() -> dict[str, set[str]]:
    """``{algorithm: {test id}}`` from the refusals file (``algorithm test-id  # reason``)."""
    table: dict[str, set[str]] = {}
    for line in REFUSALS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            algorithm, test = line.split()
            table.setdefault(algorithm, set()).add(test)
    return table


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` from one rank's JUnit file."""
    results = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}.{case.get('name')}"
        kinds = {child.tag for child in case}
        results[test] = ("failed" if kinds & {"failure", "error"} else
                         "skipped" if "skipped" in kinds else "passed")
    return results


def run(venv: Path, tests: Path, ranks: int, algorithm: str, timeout: int) -> tuple[int, Path]:
    """One mpirun of the modules; return (exit status, the folder of its rank logs)."""
    logs = ROOT / ".test-logs" / "mpi4py" / f"n{ranks}-{algorithm}"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.iterdir():
        old.unlink()
    env = dict(os.environ, MPIALLREDUCE_SUITE_ALGORITHM=algorithm,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(tests), str(ROOT)]))
    rank = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}"
    command = (f'exec > "$0/rank{rank}.log" 2>&1; exec "$1" -m mpi4py -m pytest -q --color=no '
               f'-p no:cacheprovider -p mpi4py_suite_plugin --rootdir "$2" '
               f'--junitxml "$0/rank{rank}.xml" ' + " ".join(f"{m}.py" for m in MODULES))
    status = subprocess.run(
        ["timeout", str(timeout), str(venv / "bin" / "mpirun"), "-n", str(ranks), "bash", "-c",
         command, str(logs), str(venv / "bin" / "python"), str(tests)],
        cwd=tests, env=env).returncode
    return status, logs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "mpi4py-suite")
    parser.add_argument("--only", nargs="*", default=[], metavar="N=ALG,ALG",
                        help="at -n N, only these of the algorithms")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mpirun")
    args = parser.parse_args(argv)
    only = {}
    for item in args.only:
        ranks, _, names = item.partition("=")
        chosen = [name for name in names.split(",") if name]
        unknown = set(chosen) - set(args.algorithms)
        if not ranks.isdigit() or not chosen or unknown:
            parser.error(f"--only takes N=ALG[,ALG...] with ALG among {args.algorithms}, "
                         f"got {item!r}")
        only[int(ranks)] = chosen
    venv = args.venv.resolve()
    tests = fetch(str(venv / "bin" / "python"), args.cache)
    refused = refusals()
    failures = 0
    for ranks in args.ranks:
        reference = None
        for algorithm in ("plain", *only.get(ranks, args.algorithms)):
            start = time.monotonic()
            status, logs = run(venv, tests, ranks, algorithm, args.timeout)
            seconds = time.monotonic() - start
            juntis = sorted(logs.glob("rank*.xml"))
            if status != 0 and algorithm == "plain":
                print(f"mpi4py suite -n {ranks} plain: mpi4py's own run failed (exit {status}): "
                      f"see {logs}")
                return 1
            if len(juntis) != ranks:  # a rank died or hung before pytest wrote its report
                print(f"mpi4py suite -n {ranks} {algorithm}: FAILED: exit {status}"
                      f"{' (timed out)' if status == 124 else ''}, {len(juntis)} of {ranks} "
                      f"ranks reported; see {logs}")
                tail = (logs / "rank0.log").read_text(errors="replace").splitlines()[-40:]
                print("\n".join(tail))
                failures += 1
                continue
            per_rank = [outcomes(junit) for junit in juntis]
            if reference is None:
                reference = per_rank
            allowed = refused.get(algorithm, set())
            differ = sorted({test for mine, plain in zip(per_rank, reference)
                             for test in set(mine) | set(plain)
                             if mine.get(test) != plain.get(test) and test not in allowed})
            counts = {kind: sum(v == kind for v in per_rank[0].values())
                      for kind in ("passed", "failed", "skipped")}
            verdict = "ok" if not differ and status in (0, 1) else "FAILED"
            print(f"mpi4py suite -n {ranks} {algorithm:>18}: {counts['passed']} passed, "
                  f"{counts['failed']} failed, {counts['skipped']} skipped (rank 0); "
                  f"{len(differ)} differ from plain mpi4py: {verdict} ({seconds:.0f} s)")
            for test in differ[:20]:
                print(f"    {test}: " + ", ".join(
                    f"rank {r} {mine.get(test)} (plain {plain.get(test)})"
                    for r, (mine, plain) in enumerate(zip(per_rank, reference))
                    if mine.get(test) != plain.get(test)))
            if verdict != "ok":
                failures += 1
    runs = sum(len(only.get(ranks, args.algorithms)) for ranks in args.ranks)
    print(f"mpi4py suite: {failures} of {runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
