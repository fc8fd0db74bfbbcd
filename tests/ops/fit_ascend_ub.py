"""Refit ``triton_ascend.UB_FIT``: compile the attention kernels over a tile grid to the final
HIVM (bishengir-compile, Ascend910B3) and fit the UB plan's highest end by least squares.

Why a tool and not a test: the grid is 108 compiles (several minutes on two cores). Run it in the
Ascend environment after a kernel change, then paste its coefficients into ``UB_FIT``; the
compile test checks that the model bounds every shipped launch's plan::

    env -u TRITON_INTERPRET TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-ascend/bin/python \\
        -m tests.ops.fit_ascend_ub
"""

from __future__ import annotations

import itertools
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import ascend_mepic.ops.triton_ascend as asc
from tests.ops import ascend_hivm as hivm
from tests.ops.ascend_compile import compile_stages

logger = logging.getLogger(__name__)
# Points above this share of UB are left out: there the compiler turns multi-buffering off and
# its plan saturates near the capacity.
FIT_BELOW = 0.86


def grid() -> list[tuple[tuple, str, dict]]:
    """(point, .ttadapter, metadata) over heads 64/128/256, float16/float32, NeoX/GPT-J, rows
    16/32 (decode: 16), BLOCK_N 16/32/64, cos/sin in the model dtype."""
    from tests.ops.test_ascend_compile import CORES, Config, _batch

    out = []
    for decode, head, dtype, neox in itertools.product(
        (False, True), (64, 128, 256), (torch.float16, torch.float32), (True, False)
    ):
        q, kv, meta, rope, scale = _batch(Config(head, dtype, 4 if decode else 1, decode, neox))
        for rows, block_n in itertools.product((16,) if decode else (16, 32), (16, 32, 64)):
            plan = asc.plan_launches(
                q, kv, meta, rope, scale, kernel="decode" if decode else "prefill", cores=CORES,
                block_q=None if decode else rows, block_n=block_n,
                num_splits=2 if decode else None, half_dots=dtype != torch.float32,
            )  # fmt: skip
            launch = plan.launches[0 if decode else 1]
            ir, metadata = compile_stages(launch.kernel, launch.args, launch.kwargs)
            out.append(((decode, neox, head, rows, block_n), ir["ttadapter"], metadata))
    return out


def _placed(job: tuple[tuple, str, dict]) -> tuple[tuple, int | None]:
    try:
        return job[0], hivm.compile_hivm(job[1], job[2], "Ascend910B3").used["ub"]
    except hivm.HivmError:
        return job[0], None  # over the capacity


def fit(points: list[tuple[tuple, int | None]]) -> dict[tuple[bool, bool], tuple]:
    """Per (decode, NeoX): least squares of bytes on rows*D_P, BLOCK_N*D_P, rows*BLOCK_N and 1
    over the points under ``FIT_BELOW``, scaled by the largest under-statement."""
    out = {}
    for decode, neox in itertools.product((False, True), (True, False)):
        sel = [(p, ub) for p, ub in points if p[:2] == (decode, neox) and ub
               and ub <= FIT_BELOW * asc.UB_BYTES]  # fmt: skip
        x = np.array([[r * asc.pow2_at_least(h, 16), n * asc.pow2_at_least(h, 16), r * n, 1]
                      for (_, _, h, r, n), _ in sel], float)  # fmt: skip
        y = np.array([ub for _, ub in sel], float)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        scale = float(np.max(y / (x @ coef)))
        out[(decode, neox)] = (*(round(float(c) * scale, 2) for c in coef[:3]),
                               int(np.ceil(coef[3] * scale)))  # fmt: skip
        logger.info("decode=%s neox=%s: %d points, scale %.3f", decode, neox, len(sel), scale)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with ThreadPoolExecutor(2) as pool:
        points = list(pool.map(_placed, grid()))
    for point, ub in points:
        print(point, ub)
    print("UB_FIT =", fit(points))


if __name__ == "__main__":
    main()
