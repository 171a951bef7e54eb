"""Serial checks of the op table: which (op, dtype) pairs MPI defines, and the local combine."""

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.ops import DTYPES, reducer
from mpiallreduce.schedule import LOCAL_FIRST, RECEIVED_FIRST


@pytest.mark.parametrize("op, dtype", [(MPI.BAND, "float64"), (MPI.MIN, "complex128"),
                                       (MPI.SUM, "bool"), (MPI.BXOR, "bool"),
                                       (mar.AVG, "int32"), (MPI.LAND, "float32")])
def test_op_not_defined_for_dtype_is_a_type_error_naming_both(op, dtype):
    with pytest.raises(TypeError) as info:
        reducer(op, np.dtype(dtype))
    assert dtype in str(info.value)


@pytest.mark.parametrize("dtype", ["float16", "object", ">f8", "U3"])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="no predefined MPI datatype"):
        reducer(MPI.SUM, np.dtype(dtype))


def test_not_an_op():
    with pytest.raises(TypeError, match="MPI.Op"):
        reducer("sum", np.dtype("float64"))
    with pytest.raises(TypeError, match="not supported"):
        reducer(MPI.REPLACE, np.dtype("float64"))


def test_every_dtype_has_sum_or_logical_ops():
    for dtype in DTYPES:
        op = MPI.LOR if dtype == np.bool_ else MPI.SUM
        assert reducer(op, dtype).ufunc is not None


def _affine(inbuf, inoutbuf, datatype):
    # (a, b) ∘ (c, d) = (a·c, a·d + b): composition of affine maps, associative, not commutative
    x = np.frombuffer(inbuf, dtype=np.int64).reshape(-1, 2)
    y = np.frombuffer(inoutbuf, dtype=np.int64).reshape(-1, 2)
    a, b = x[:, 0].copy(), x[:, 1].copy()
    c, d = y[:, 0].copy(), y[:, 1].copy()
    y[:, 0] = a * c
    y[:, 1] = a * d + b


def test_user_op_keeps_operand_order():
    op = MPI.Op.Create(_affine, commute=False)
    try:
        red = reducer(op, np.dtype("int64"))
        assert not red.commutative
        left, right = np.array([2, 3]), np.array([5, 7])
        local = left.copy()
        red.combine(right.copy(), local, LOCAL_FIRST)  # left ∘ right
        assert local.tolist() == [10, 2 * 7 + 3]
        local = left.copy()
        red.combine(right.copy(), local, RECEIVED_FIRST)  # right ∘ left
        assert local.tolist() == [10, 5 * 3 + 7]
    finally:
        op.Free()
