"""Summarise an Nsight Compute CSV report (``ncu --csv --page raw``) of ``bench_triton_gpu.py
--profile`` as a markdown table: per kernel launch, its NVTX label (or kernel name), time, DRAM
throughput as a share of peak, local-memory load sectors, tensor-pipe activity, registers and
occupancy. Standard library only (it runs wherever ncu does). Written by ``scripts/gpu_ncu.sh``;
UNTESTED ON A GPU (the parser is tested here on a small report of ncu's documented format).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

# Column title -> the metric names it may come from (the first present wins).
COLUMNS = {
    "time us": ["gpu__time_duration.sum"],
    "DRAM % peak": ["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
    "local ld sectors": ["l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum"],
    "tensor pipe % (mma)": [
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    ],
    "tensor pipe % (wgmma)": [
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
    ],
    "registers": ["launch__registers_per_thread"],
    "warps active %": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
}


def read_report(text: str) -> list[dict[str, str]]:
    """The kernel rows of a raw CSV page: ncu's own lines (``==PROF==``, the application's
    output) are skipped up to the header that starts with ``"ID"``; the units row after it is
    dropped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the report')
    rows = list(csv.DictReader(lines[start:]))
    return [r for r in rows if r.get("ID", "").strip().isdigit()]


def summarise(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    out = []
    for r in rows:
        item = {"kernel": r.get("Kernel Name", "?")[:60]}
        for title, names in COLUMNS.items():
            value = next((r[n] for n in names if r.get(n, "") not in ("", "n/a")), "-")
            if title == "time us" and value != "-":
                value = f"{float(value.replace(',', '')) / 1000:.1f}"  # ns -> us
            item[title] = value
        out.append(item)
    return out


def markdown(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no kernel in the report)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: ncu_summary.py REPORT.csv")
    print(markdown(summarise(read_report(Path(sys.argv[1]).read_text()))))


if __name__ == "__main__":
    main()
