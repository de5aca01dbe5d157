#!/usr/bin/env python3
"""A ceiling for the experts' weight-gradient GEMM (docs/benchmarks.md, "The weight gradient"):
dw_e = dy_e^T x_e for E experts of m rows each, bf16 in and out, f32 accumulation, timed as
cuBLAS's strided batched GEMM (torch.bmm over equal experts: no grouping, no padding) and as
PyTorch's grouped GEMM (torch._grouped_mm with offsets, what the PyTorch layer of
bench_bar_moe.py runs). Medians of --reps after --warmup, CUDA events; TFLOP/s = 2 E m O I / t.

    python3 scripts/wgrad_ceiling.py --experts 256 --rows 256 --out 4096 --in 7168
"""
import argparse
import statistics

import torch


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--rows", type=int, default=256, help="rows per expert (the GEMM's K)")
    p.add_argument("--out", type=int, default=4096, help="the weight's O (fc1: 2 F)")
    p.add_argument("--in", dest="in_", type=int, default=7168, help="the weight's I")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="print the CUDA kernels each one runs")
    a = p.parse_args()
    e, m, o, i = a.experts, a.rows, a.out, a.in_
    dev = torch.device("cuda")
    dy = torch.randn(e * m, o, device=dev, dtype=torch.bfloat16)
    x = torch.randn(e * m, i, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(e, o, i, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * e * m * o * i
    # Strided batched: dy viewed [E, m, O] transposed to [E, O, m], times x [E, m, I].
    dy3, x3 = dy.view(e, m, o), x.view(e, m, i)
    bmm = lambda: torch.bmm(dy3.transpose(1, 2), x3, out=dw)  # noqa: E731
    ms = timed(bmm, a.reps, a.warmup)
    print(f"wgrad E {e} m {m} O {o} I {i}: cuBLAS strided batched {ms:.3f} ms, {flop / ms / 1e9:.1f} TFLOP/s")
    if a.kernels:
        print("  kernels:", "; ".join(kernel_names(bmm)))
    if hasattr(torch, "_grouped_mm"):
        offs = torch.arange(m, e * m + 1, m, device=dev, dtype=torch.int32)
        grouped = lambda: torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
        ms = timed(grouped, a.reps, a.warmup)
        print(f"wgrad E {e} m {m} O {o} I {i}: torch._grouped_mm {ms:.3f} ms, {flop / ms / 1e9:.1f} TFLOP/s")
        if a.kernels:
            print("  kernels:", "; ".join(kernel_names(grouped)))


if __name__ == "__main__":
    main()
