"""The compiled part of mpiallreduce (pyproject.toml holds everything else).

``mpiallreduce/_compiled.pyx`` (the call path's per-call part and shm's small regime) is
compiled with Cython and the system C compiler where both exist. It is optional: where the
compiler is missing or fails, the install goes on with the pure-Python form, which is the
reference (``python -m mpiallreduce`` says which form is active).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "mpiallreduce/_compiled.pyx"


#: GCC's flags that vectorise the loops; a compiler that refuses them builds without them
VECTORISE = ["-ftree-loop-vectorize", "-fvect-cost-model=dynamic"]


class optional_build_ext(build_ext):
    """build_ext that, where the extension fails to build, tries again without
    :data:`VECTORISE`, then says so once and goes on with the Python form."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
            return
        except Exception as exc:  # no compiler, or it failed
            failure = exc
        if any(flag in ext.extra_compile_args for flag in VECTORISE):
            ext.extra_compile_args = [f for f in ext.extra_compile_args if f not in VECTORISE]
            try:
                super().build_extension(ext)
                print("mpiallreduce: the compiler refused " + " ".join(VECTORISE)
                      + "; built without them (shm's small-regime loops may stay scalar)",
                      file=sys.stderr)
                return
            except Exception as exc:
                failure = exc
        reason = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
        if len(reason) > 100:
            reason = reason[:100] + "..."
        print(f"mpiallreduce: the compiled call path was not built ({reason}); installing "
              f"the pure-Python form", file=sys.stderr)
        # an earlier build left in the source tree (an editable install) would be imported
        # instead, and no longer match the Python modules: remove it
        stale = os.path.join(os.path.dirname(SOURCE),
                             os.path.basename(self.get_ext_filename(ext.name)))
        if os.path.exists(stale):
            os.remove(stale)


def extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError:  # built without build isolation and without Cython: Python form
        print("mpiallreduce: Cython is not installed; installing the pure-Python form",
              file=sys.stderr)
        return []
    import numpy

    # IEEE adds in the order written, as NumPy's ufuncs do (no fused multiply-add); loops
    # vectorised (-O2 alone leaves shm's combine loops scalar: its very cheap cost model refuses
    # the run-time check that the result does not overlap the slots), element by element in
    # the same order, so the same bits
    ext = Extension("mpiallreduce._compiled", [SOURCE], optional=True,
                    include_dirs=[numpy.get_include()],
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                    extra_compile_args=["-O2", "-ffp-contract=off", *VECTORISE])
    try:
        # (every extension here is optional: cythonize's copies lose the flag)
        return cythonize([ext], compiler_directives={"language_level": 3}, quiet=True)
    except Exception as exc:  # (a Cython too old or too new for the source)
        print(f"mpiallreduce: Cython failed ({exc}); installing the pure-Python form",
              file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": optional_build_ext})
