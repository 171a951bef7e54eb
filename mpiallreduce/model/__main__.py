"""python -m mpiallreduce.model predict|calibrate.

An entry point, a client of the package like ``mpiallreduce/__main__.py``: ``predict`` is the
model's own (:mod:`mpiallreduce.model.cli`, no MPI); ``calibrate`` runs MPI to measure this
machine and is handed to :mod:`mpiallreduce.calibrate`, above the model's layer.
"""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        from ..calibrate import main as calibrate

        return calibrate(argv[1:], prog="python -m mpiallreduce.model calibrate")
    from .cli import main as predict

    return predict(argv)


if __name__ == "__main__":
    sys.exit(main())
