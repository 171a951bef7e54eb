"""python -m mpiallreduce.model predict|calibrate (see :mod:`mpiallreduce.model.cli`)."""

import sys

from .cli import main

sys.exit(main())
