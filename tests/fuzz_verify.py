"""Random float calls with PYCOLL_VERIFY=1 that must raise no false alarm: every float dtype,
1-9 in-process ranks, AllReduce, ReduceScatter and Reduce with every family and forced segment
counts, sum, avg and prod on values of magnitude 1e-6 to 1e5 (float16 sums and products
overflowing among them). A script, not a test (minutes per few hundred cases):

    python tests/fuzz_verify.py SEED CASES     # prints each false alarm, then the count
"""

from __future__ import annotations

import os
import sys
import warnings

import ml_dtypes
import numpy as np

os.environ["PYCOLL_VERIFY"] = "1"
import pycoll  # noqa: E402  (after the setting: worlds read it when made)
from pycoll import select  # noqa: E402

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128]
FAMILIES = {"allreduce": ["ring", "tree", "halving_doubling", "direct", "two_shot", "auto"],
            "reduce_scatter": ["ring", "tree", "halving_doubling", "direct", "auto"],
            "reduce": ["ring", "tree", "auto"]}


def main(seed: int, cases: int) -> int:
    warnings.simplefilter("ignore", RuntimeWarning)  # overflow in float16 sums, by design
    rng = np.random.default_rng(seed)
    alarms = 0
    for _ in range(cases):
        nranks = int(rng.integers(1, 10))
        dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        op = ["sum", "avg", "prod"][rng.integers(3)]
        name = list(FAMILIES)[rng.integers(3)]
        algorithm = FAMILIES[name][rng.integers(len(FAMILIES[name]))]
        count = int(rng.integers(0, 60)) * nranks
        scale = 10.0 ** rng.integers(-6, 6)
        select.FORCED_SEGMENTS = [None, 1, 2, 3][rng.integers(4)]
        values_seed = int(rng.integers(1 << 30))

        def body(dtype=dtype, op=op, name=name, algorithm=algorithm, count=count, scale=scale,
                 values_seed=values_seed, nranks=nranks):
            rank = pycoll.world().rank
            values = np.random.default_rng([values_seed, rank])
            spread = scale if op != "prod" else 0.3
            x = values.normal(size=count) * spread + (scale if op == "prod" else 0)
            if dtype.kind == "c":
                x = x + 1j * values.normal(size=count) * spread
            x = x.astype(dtype)
            if name == "reduce":
                return pycoll.reduce(x, op, root=nranks - 1, algorithm=algorithm)
            return getattr(pycoll, name)(x, op, algorithm=algorithm)

        try:
            pycoll.run_local(nranks, body)
        except pycoll.VerificationError as error:
            alarms += 1
            print("false alarm:", nranks, dtype, op, name, algorithm, count, scale, error)
    select.FORCED_SEGMENTS = None
    print(f"{cases} cases, false alarms: {alarms}")
    return alarms


if __name__ == "__main__":
    sys.exit(min(main(int(sys.argv[1]), int(sys.argv[2])), 1))
