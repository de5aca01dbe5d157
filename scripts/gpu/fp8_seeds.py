#!/usr/bin/env python3
"""Summary of `scripts/gpu/fp8.sh seeds`: DIR/<family>_<arm>_<seed>/metrics.jsonl, arms none (bf16),
blockwise (FP8) and control (bf16 with other kernels of the same math). Runs here too, on the files a
device call brought back:  python3 scripts/gpu/fp8_seeds.py DIR

Per family and arm: the mean over seeds of each run's last-100-step mean training loss and last eval
loss, with their spread. FP8 and the control against bf16, and FP8 against the control, paired by
seed: the differences, their mean and standard error, median, Hodges-Lehmann estimate, 10%-trimmed
mean, mean and largest absolute value, how many the arm lost. The control's
differences are the noise floor: what a perturbation of the last bits alone does to a 1000-step run
whose trajectory can part at a loss plateau; FP8's are read against them. Per seed and arm, where the
curves part (the largest gap of the 50-step running means and its step, each arm's largest gradient
norm and skipped steps, the worst layer's last expert balance)."""
import json
import os
import statistics as st
import sys

ARMS = ("none", "blockwise", "control")


def load(base):
    runs = {}  # (family, seed) -> {arm: rows}
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name, "metrics.jsonl")
        if not os.path.isfile(path):
            continue
        fam, arm, seed = name.rsplit("_", 2)
        rows = [json.loads(line) for line in open(path)]
        if rows:
            runs.setdefault((fam, int(seed)), {})[arm] = rows
    return runs


def last100(rows):
    tail = rows[-100:]
    return sum(r["loss"] for r in tail) / len(tail)


def last_eval(rows):
    ev = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return ev[-1] if ev else float("nan")


def running_mean(rows, i):
    w = rows[max(0, i - 49):i + 1]
    return sum(r["loss"] for r in w) / len(w)


def worst(rows):
    g, i = max((r["grad_norm"], r["step"]) for r in rows)
    load = rows[-1].get("expert_load_max_over_mean") or [float("nan")]  # per MoE layer
    load = max(load) if isinstance(load, list) else load
    skipped = sum(1 for r in rows if r.get("skipped"))
    return f"max grad_norm {g:.3f} at {i}, {skipped} skipped, last load max/mean (worst layer) {load:.2f}"


def curve_line(fam, seed, arm, a, b):
    n = min(len(a), len(b))
    gap, at = max(((running_mean(b, i) - running_mean(a, i)) / running_mean(a, i), i + 1) for i in range(n))
    low, low_at = min(((running_mean(b, i) - running_mean(a, i)) / running_mean(a, i), i + 1) for i in range(n))
    return (f"{fam} seed {seed} {arm}: 50-step gap {arm} - bf16 largest {gap * 100:+.2f}% at step {at}, "
            f"smallest {low * 100:+.2f}% at step {low_at}; bf16 {worst(a)}; {arm} {worst(b)}")


def hodges_lehmann(d):
    """The median of all pairwise means (i <= j): a centre that a few parted trajectories do not move."""
    return st.median((d[i] + d[j]) / 2 for i in range(len(d)) for j in range(i, len(d)))


def trimmed_mean(d, share):
    """The mean without the lowest and highest `share` of the values (int(share * n) each side)."""
    k = int(share * len(d))
    kept = sorted(d)[k:len(d) - k]
    return st.mean(kept)


def main(base):
    runs = load(base)
    for fam in sorted({f for f, _ in runs}):
        seeds = sorted(s for f, s in runs if f == fam)
        means = {}
        for arm in ARMS:
            v = [(last100(runs[(fam, s)][arm]), last_eval(runs[(fam, s)][arm])) for s in seeds if arm in runs[(fam, s)]]
            if not v:
                continue
            l100, evs = [a for a, _ in v], [b for _, b in v]
            means[arm] = (st.mean(l100), st.mean(evs))
            print(f"{fam} {arm}: last-100 mean {st.mean(l100):.4f} ({min(l100):.4f}..{max(l100):.4f}), "
                  f"eval {st.mean(evs):.4f} ({min(evs):.4f}..{max(evs):.4f}), {len(v)} seeds")
            print(f"{fam} {arm} per seed (last-100 mean / eval): " + " ".join(
                f"{s}:{last100(runs[(fam, s)][arm]):.4f}/{last_eval(runs[(fam, s)][arm]):.4f}"
                for s in seeds if arm in runs[(fam, s)]))
        if "none" not in means:
            continue
        # Each arm against bf16, and FP8 against the control (both off bf16 by rounding alone or
        # by FP8 as well), paired by seed, relative to bf16's mean.
        for arm, ref in (("blockwise", "none"), ("control", "none"), ("blockwise", "control")):
            paired = [s for s in seeds if arm in runs[(fam, s)] and ref in runs[(fam, s)]]
            if not paired:
                continue
            for what, f in (("last-100 mean", last100), ("eval", last_eval)):
                base_mean = st.mean(f(runs[(fam, s)]["none"]) for s in paired if "none" in runs[(fam, s)])
                d = [f(runs[(fam, s)][arm]) - f(runs[(fam, s)][ref]) for s in paired]
                pct = lambda x: x / base_mean * 100  # noqa: E731
                se = st.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
                absd = [abs(x) for x in d]
                name = "bf16" if ref == "none" else ref
                print(f"{fam}: {arm} - {name} paired by seed ({len(d)}), {what}: mean {pct(st.mean(d)):+.2f}% +- "
                      f"{pct(se):.2f}%, median {pct(st.median(d)):+.2f}%, Hodges-Lehmann {pct(hodges_lehmann(d)):+.2f}%, "
                      f"10%-trimmed mean {pct(trimmed_mean(d, 0.1)):+.2f}%, mean |d| {pct(st.mean(absd)):.2f}%, "
                      f"largest |d| {pct(max(absd)):.2f}%, {arm} worse in {sum(x > 0 for x in d)} of {len(d)}, "
                      f"identical in {sum(x == 0 for x in d)}; "
                      + " ".join(f"{s}:{x:+.4f}" for s, x in zip(paired, d)))
        for s in seeds:
            for arm in ARMS[1:]:
                if arm in runs[(fam, s)] and "none" in runs[(fam, s)]:
                    print(curve_line(fam, s, arm, runs[(fam, s)]["none"], runs[(fam, s)][arm]))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: fp8_seeds.py DIR  (DIR/<family>_<arm>_<seed>/metrics.jsonl)")
    main(sys.argv[1])
