#!/usr/bin/env python3
"""The PyTorch bar for `moefold bench moe-layer` (docs/benchmarks.md "Ceilings and bars"): one MoE
layer as modern PyTorch training code writes it (router, argsort permutation, torch._grouped_mm
for the experts, SwiGLU, weighted index_add un-permutation, the shared experts as dense GEMMs),
bf16 weights and gradients, dropless, forward + backward, timed with CUDA events. TFLOP/s use
moefold's FLOP count (3 x forward: router 2THE, experts 6KTHF, shared 6THF_shared), so the two
tables divide. Needs a GPU and PyTorch >= 2.8 (torch._grouped_mm); run it in the same device call
as the moefold bench it is compared with.

    python3 scripts/bench_bar_moe.py --shape deepseek-v3 --routing real --reps 5

--floor times the layer's GEMMs alone instead (cuBLAS's batched and dense GEMMs at balanced
routing's equal experts, back to back): what the layer's GEMM time cannot go below at cuBLAS's
rate; and the bytes its memory-bound stages must move, at the GPU's copy bandwidth. --tokens and
--experts change every shape's (the halved DeepSeek-V3 layer: 4096 and 128).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

# The presets' MoE shapes (`moefold config --config NAME`) and the tokens the bench uses.
SHAPES = {
    "qwen3-30b-a3b": dict(h=2048, e=128, k=8, f=768, shared=0, t=16384, score="softmax", groups=1, topk_groups=1,
                          scale=1.0),
    "qwen3-235b-a22b": dict(h=4096, e=128, k=8, f=1536, shared=0, t=8192, score="softmax", groups=1, topk_groups=1,
                            scale=1.0),
    "deepseek-v3": dict(h=7168, e=256, k=8, f=2048, shared=1, t=8192, score="sigmoid", groups=8, topk_groups=4,
                        scale=2.5),
    "mixtral-8x7b": dict(h=4096, e=8, k=2, f=14336, shared=0, t=8192, score="softmax", groups=1, topk_groups=1,
                         scale=1.0),
}


class MoeLayer(torch.nn.Module):
    def __init__(self, s, dev):
        super().__init__()
        self.s = s
        h, e, f, fs = s["h"], s["e"], s["f"], s["f"] * s["shared"]
        bf = dict(device=dev, dtype=torch.bfloat16)
        self.router = torch.nn.Parameter(torch.randn(e, h, **bf) * 0.02)
        self.w1 = torch.nn.Parameter(torch.randn(e, h, 2 * f, **bf) * 0.02)  # [E, K, N] for _grouped_mm
        self.w2 = torch.nn.Parameter(torch.randn(e, f, h, **bf) * 0.02)
        self.bias = torch.zeros(e, device=dev)  # DeepSeek-V3's selection bias (zero at the start)
        if fs:
            self.ws1 = torch.nn.Parameter(torch.randn(h, 2 * fs, **bf) * 0.02)
            self.ws2 = torch.nn.Parameter(torch.randn(fs, h, **bf) * 0.02)

    def route(self, x, balanced):
        s = self.s
        t, e, k = x.shape[0], s["e"], s["k"]
        logits = (x @ self.router.t()).float()
        scores = torch.sigmoid(logits) if s["score"] == "sigmoid" else torch.softmax(logits, dim=-1)
        if balanced:  # token t's k-th expert is (t*K + k) mod E, weights 1/K (moefold's balanced routing)
            idx = (torch.arange(t * k, device=x.device) % e).view(t, k)
            return idx, torch.full((t, k), 1.0 / k, device=x.device)
        sel = scores + self.bias
        if s["groups"] > 1:  # group-limited: the best topk_groups groups by the sum of their top-2
            groups = sel.view(t, s["groups"], -1).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(groups, dtype=torch.bool)
            keep.scatter_(1, groups.topk(s["topk_groups"], dim=-1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(e // s["groups"], dim=1), float("-inf"))
        idx = sel.topk(k, dim=-1).indices
        prob = scores.gather(1, idx)
        prob = prob / prob.sum(-1, keepdim=True) * s["scale"]
        return idx, prob

    def forward(self, x, balanced):
        s = self.s
        k, e = s["k"], s["e"]
        idx, prob = self.route(x, balanced)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32)
        tok = order // k
        gu = torch._grouped_mm(x[tok], self.w1, offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offs)
        y = y * prob.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(x).index_add(0, tok, y)
        if s["shared"]:
            sg, su = (x @ self.ws1).chunk(2, dim=-1)
            out = out + (F.silu(sg) * su) @ self.ws2
        return out


def median_ms(body, reps, warmup, before=None):
    """The median over reps of body's time on the GPU (CUDA events), after warmup runs; before
    runs ahead of each, untimed."""
    times = []
    for i in range(warmup + reps):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(name, routing, reps, warmup):
    s = SHAPES[name]
    dev = torch.device("cuda")
    torch.manual_seed(2026)
    layer = MoeLayer(s, dev)
    t, h = s["t"], s["h"]
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16) / t
    balanced = routing == "balanced"

    def no_grads():  # every repetition writes its gradients (a step's first micro-batch)
        for p in list(layer.parameters()) + [x]:
            p.grad = None

    ms = median_ms(lambda: layer(x, balanced).backward(dy), reps, warmup, no_grads)
    fwd = 2 * t * h * s["e"] + 6 * s["k"] * t * h * s["f"] + 6 * t * h * s["f"] * s["shared"]
    print(f"bar {name} {routing}: {ms:.3f} ms, {3 * fwd / ms / 1e9:.1f} TFLOP/s (PyTorch {torch.__version__}, "
          f"torch._grouped_mm, bf16 gradients)", flush=True)


def floor(name, reps, warmup):
    """The layer's GEMMs alone, back to back, as cuBLAS runs them at their best: the experts as
    strided batched GEMMs (balanced routing: every expert t*K/E rows, no groups, no permutation),
    the shared experts as dense GEMMs, bf16 in and out. Nothing else of the layer (router,
    permutation, SwiGLU, combine) runs, so this is a floor for the layer's GEMM time under the
    same sustained load, not a layer. Then the memory-bound stages' floor: the bytes they must
    move at the rate of one large device copy; the two together bound the layer from below."""
    s = SHAPES[name]
    dev = torch.device("cuda")
    torch.manual_seed(2026)
    t, h, e, k, f, fs = s["t"], s["h"], s["e"], s["k"], s["f"], s["f"] * s["shared"]
    m = t * k // e
    bf = dict(device=dev, dtype=torch.bfloat16)
    r = lambda *shape: torch.randn(*shape, **bf) * 0.02  # noqa: E731
    x, w1, w2, hh = r(e, m, h), r(e, h, 2 * f), r(e, f, h), r(e, m, f)
    dy, dgu = r(e, m, h), r(e, m, 2 * f)
    gemms = [  # (name, FLOPs, call)
        ("fc1 forward", 2 * e * m * h * 2 * f, lambda: torch.bmm(x, w1)),
        ("fc2 forward", 2 * e * m * f * h, lambda: torch.bmm(hh, w2)),
        ("fc2 dgrad", 2 * e * m * h * f, lambda: torch.bmm(dy, w2.transpose(1, 2))),
        ("fc2 wgrad", 2 * e * m * f * h, lambda: torch.bmm(hh.transpose(1, 2), dy)),
        ("fc1 dgrad", 2 * e * m * 2 * f * h, lambda: torch.bmm(dgu, w1.transpose(1, 2))),
        ("fc1 wgrad", 2 * e * m * h * 2 * f, lambda: torch.bmm(x.transpose(1, 2), dgu)),
    ]
    if fs:
        xs, ws1, gus, ws2, hs, dys = r(t, h), r(h, 2 * fs), r(t, 2 * fs), r(fs, h), r(t, fs), r(t, h)
        gemms += [
            ("shared fc1 forward", 2 * t * h * 2 * fs, lambda: xs @ ws1),
            ("shared fc2 forward", 2 * t * fs * h, lambda: hs @ ws2),
            ("shared fc2 dgrad", 2 * t * h * fs, lambda: dys @ ws2.t()),
            ("shared fc2 wgrad", 2 * t * fs * h, lambda: hs.t() @ dys),
            ("shared fc1 dgrad", 2 * t * 2 * fs * h, lambda: gus @ ws1.t()),
            ("shared fc1 wgrad", 2 * t * h * 2 * fs, lambda: xs.t() @ gus),
        ]

    def timed(calls):
        def body():
            for c in calls:  # each result dropped at once (ten 7 GB outputs kept alive did not fit 80 GB)
                c()

        return median_ms(body, reps, warmup)

    total = timed([g[2] for g in gemms])
    flops = sum(g[1] for g in gemms)
    print(f"floor {name}: the layer's GEMMs back to back {total:.3f} ms, {flops / total / 1e9:.1f} TFLOP/s "
          f"(cuBLAS batched/dense, {e} experts of {m} rows)", flush=True)
    for g_name, g_flops, call in gemms:  # each alone, ten in a row (the same sustained load)
        ms = timed([call] * 10) / 10
        print(f"floor {name}: {g_name} {ms:.3f} ms, {g_flops / ms / 1e9:.1f} TFLOP/s", flush=True)

    # The memory-bound stages at the GPU's copy bandwidth: the bytes each must at least read and
    # write (bf16; the router, the probabilities and the SwiGLU of the routed experts, which moefold
    # does in its GEMMs' epilogues, left out), at the rate of one large device copy.
    th, rh = 2 * t * h, 2 * t * k * h
    stages = {"dispatch": th + rh, "combine": rh + th, "combine backward": th + 2 * rh,
              "dispatch backward": rh + th}
    if fs:
        stages["shared SwiGLU forward and backward"] = 2 * t * 8 * fs
        stages["shared output and input gradient added"] = 2 * 3 * th
    del x, w1, w2, hh, dy, dgu, gemms
    torch.cuda.empty_cache()
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_ms = timed([lambda: dst.copy_(src)] * 10) / 10
    bandwidth = 2 * src.numel() / copy_ms / 1e9  # TB/s, read and written
    moved = sum(stages.values())
    mem_ms = moved / bandwidth / 1e9
    each = ", ".join(f"{n} {b / 1e9:.2f} GB" for n, b in stages.items())
    print(f"floor {name}: memory-bound stages {mem_ms:.3f} ms for {moved / 1e9:.2f} GB at the copy's "
          f"{bandwidth:.2f} TB/s ({each})", flush=True)
    print(f"floor {name}: GEMMs and memory-bound stages {total + mem_ms:.3f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    ap.add_argument("--routing", action="append", choices=["balanced", "real"], help="default: both")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--floor", action="store_true",
                    help="instead of the layer: its GEMMs alone at cuBLAS's rate (balanced), and the bytes "
                    "its memory-bound stages move at copy speed")
    ap.add_argument("--tokens", type=int, help="instead of the shape's tokens (as bench moe-layer --tokens)")
    ap.add_argument("--experts", type=int, help="instead of the shape's experts (as --set moe.num_experts=N)")
    a = ap.parse_args()
    for s in SHAPES.values():
        s.update({k: v for k, v in (("t", a.tokens), ("e", a.experts)) if v})
    if a.floor:
        for name in a.shape or list(SHAPES):
            floor(name, a.reps, a.warmup)
            torch.cuda.empty_cache()
        return
    for name in a.shape or list(SHAPES):
        for routing in a.routing or ["balanced", "real"]:
            run(name, routing, a.reps, a.warmup)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
