#!/usr/bin/env python3
"""Every kernel of an ncu run as one line: its time, the DRAM bytes it read and wrote, their rate,
the tensor pipe's share of its cycles and the SMs' clock; then the sum. From a raw-page CSV of ncu:

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__cycles_elapsed.avg.per_second --csv --page raw ... <binary> > kernels.csv
    python3 scripts/gpu/ncu_kernels.py kernels.csv

ncu runs the kernels one at a time, so the sum leaves out the gaps between them (and the overlap
of kernels on two streams)."""
import csv
import re
import sys

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
CLOCK = "sm__cycles_elapsed.avg.per_second"

# To seconds, bytes and percent from the units ncu writes in its second header row.
SCALE = {"hz": 1.0, "Khz": 1e3, "Mhz": 1e6, "Ghz": 1e9, "khz": 1e3, "mhz": 1e6, "ghz": 1e9,
         "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3,
         "second": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0}


def short(name: str) -> str:
    """The kernel's name without its template arguments and namespaces, at most 60 characters."""
    depth, out = 0, []
    for ch in name.replace("(anonymous namespace)", "").removeprefix("void "):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    base = re.sub(r"\(.*$", "", "".join(out)).split("::")[-1] or name
    # CUTLASS's kernels are all device_kernel: what tells them apart is in the template arguments.
    tags = [tag for key, tag in (("Pingpong", "ping-pong"), ("Cooperative", "cooperative"),
                                 ("SwigluPairsStore", "SwiGLU forward"), ("SwigluPairsBackward", "SwiGLU backward"),
                                 ("GroupProblemShape", "grouped"), ("ColumnMajor, cutlass::layout::RowMajor", "A^T"))
            if key in name]
    return (base + (" [" + ", ".join(tags) + "]" if tags else ""))[:70]


def main() -> int:
    lines = [line for line in open(sys.argv[1], newline="") if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        print(f"{sys.argv[1]}: no kernels")
        return 1
    head, units = rows[0], rows[1]
    col = {name: head.index(name) for name in ("Kernel Name", TIME, READ, WRITE) if name in head}
    if len(col) < 4:
        print(f"{sys.argv[1]}: missing columns {[n for n in ('Kernel Name', TIME, READ, WRITE) if n not in col]}")
        return 1
    tensor = head.index(TENSOR) if TENSOR in head else None
    clock = head.index(CLOCK) if CLOCK in head else None

    def value(r, i):
        try:
            return float(r[i].replace(",", "")) * SCALE.get(units[i], 1.0)
        except ValueError:
            return 0.0

    total_t = total_b = 0.0
    print(f"{'#':>3} {'us':>9} {'GB read':>8} {'GB written':>10} {'TB/s':>6} {'tensor %':>8} {'MHz':>5}  kernel")
    for n, r in enumerate(rows[2:]):
        t, rd, wr = value(r, col[TIME]), value(r, col[READ]), value(r, col[WRITE])
        tp = f"{value(r, tensor):8.1f}" if tensor is not None else f"{'-':>8}"
        mhz = f"{value(r, clock) / 1e6:5.0f}" if clock is not None else f"{'-':>5}"
        total_t += t
        total_b += rd + wr
        print(f"{n:>3} {t * 1e6:9.1f} {rd / 1e9:8.3f} {wr / 1e9:10.3f} {(rd + wr) / t / 1e12 if t else 0:6.2f} {tp} {mhz}  "
              f"{short(r[col['Kernel Name']])}")
    print(f"sum {total_t * 1e3:.3f} ms over {len(rows) - 2} kernels, {total_b / 1e9:.2f} GB through DRAM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
