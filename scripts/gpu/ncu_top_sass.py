#!/usr/bin/env python3
"""The SASS instructions where a kernel's warps stall most, from a source-page CSV of ncu:

    ncu --section SourceCounters --section WarpStateStats -o rep ... <binary>
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/gpu/ncu_top_sass.py sass.csv [N]

prints each of the N (default 30) instructions with the most warp-stall samples, its share of all
samples, address and text."""
import csv
import sys


def main() -> int:
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    at = next((i for i, r in enumerate(rows) if "Source" in r and any("Warp Stall Sampling (All" in c for c in r)), None)
    if at is None:
        print(f"{sys.argv[1]}: no source page with warp stall samples (profile with --section SourceCounters)")
        return 1
    head = rows[at]
    text, samples = head.index("Source"), next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    found = []
    for r in rows[at + 1:]:
        try:
            found.append((float(r[samples] or 0), r[0], r[text]))
        except (ValueError, IndexError):
            continue
    total = sum(f[0] for f in found) or 1.0
    print(f"{int(total)} samples over {len(found)} instructions")
    for n, address, sass in sorted(found, reverse=True)[:top]:
        print(f"{100 * n / total:5.1f}% {address} {sass.strip()[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
