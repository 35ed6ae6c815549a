"""Element-wise reduction kernels; ``host`` is the numpy reference instance."""

from .host import (
    SUPPORTED_DTYPES,
    ReduceOp,
    check_dtype,
    check_op_for_dtype,
    finish,
    reduce_into,
    reducer,
)

__all__ = [
    "ReduceOp",
    "SUPPORTED_DTYPES",
    "check_dtype",
    "check_op_for_dtype",
    "reduce_into",
    "reducer",
    "finish",
]
