#!/usr/bin/env python3
"""Expert loads of Hugging Face transformers' own Qwen3-MoE / DeepSeek-V3 on moefold's data.

The independent side of docs/expert-load.md: builds the model from a config.json that
`moefold convert --to-hf` wrote (the same shapes), initialises it either with transformers' own
_init_weights (--init hf) or with the exported weights (--init file: moefold's initialisation),
samples random windows of a moefold .tokens file (the default corpus a run prepared), and
trains with AdamW under the same schedule as moefold (linear warmup, cosine decay, clipping at
1.0), printing per MoE layer and step the busiest expert's load over the mean (tokens summed
over the step's micro-batches), and at the first step how alike the tokens' router inputs are
(mean cosine similarity to the mean input, and the fraction of its energy in the common
direction).

Balancing as transformers has it: Qwen3-MoE's load_balancing_loss_func with
router_aux_loss_coef; DeepSeek-V3 has no update of e_score_correction_bias in transformers, so
--bias-rate applies DeepSeek's rule (bias += rate * sign(mean - load)) after each step, as
moefold and Megatron-Core do. Run on the GPU machine (python3 there has torch + transformers).
"""
import argparse
import json
import math
import sys
import time

import numpy as np
import torch


def read_tokens(path):
    raw = np.fromfile(path, dtype=np.uint8)
    assert raw[:8].tobytes() == b"MFTOKENS", f"{path}: not an MFTOKENS file"
    bpt = int(raw[12:16].view(np.uint32)[0])
    count = int(raw[16:24].view(np.uint64)[0])
    dt = np.uint16 if bpt == 2 else np.uint32
    return np.frombuffer(raw[24:24 + count * bpt].tobytes(), dtype=dt).astype(np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--init", choices=["hf", "file"], default="hf")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--schedule-steps", type=int, default=300)
    ap.add_argument("--bias-rate", type=float, default=0.0)
    ap.add_argument("--aux-coef", type=float, default=None, help="override router_aux_loss_coef")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--label", default="hf")
    a = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(a.seed)
    cfg = AutoConfig.from_pretrained(a.hf_dir)
    family = cfg.model_type
    if family == "qwen3_moe":
        cfg.output_router_logits = True
        if a.aux_coef is not None:
            cfg.router_aux_loss_coef = a.aux_coef
    t0 = time.time()
    if a.init == "file":
        model = AutoModelForCausalLM.from_pretrained(a.hf_dir, config=cfg, dtype=torch.float32, device_map="cuda")
    else:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    if a.init == "file" and family != "qwen3_moe":  # the export ran one step (lr ~0) whose bias update moved it
        with torch.no_grad():
            for l in model.model.layers:
                if hasattr(l.mlp, "gate") and hasattr(l.mlp.gate, "e_score_correction_bias"):
                    l.mlp.gate.e_score_correction_bias.zero_()
    print(f"[{a.label}] {family} built ({a.init} init) in {time.time() - t0:.1f} s; "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)

    layers = model.model.layers
    moe_layers = [i for i, l in enumerate(layers) if hasattr(l.mlp, "gate") and hasattr(l.mlp, "experts")]
    E = cfg.num_experts if family == "qwen3_moe" else cfg.n_routed_experts
    K = cfg.num_experts_per_tok
    counts = {i: torch.zeros(E, dtype=torch.float64, device="cuda") for i in moe_layers}
    inputs_seen = {}

    def select(i, logits):  # the routing rule of the family, as transformers' modules have it
        logits = logits.float()
        if family == "qwen3_moe":
            return torch.topk(torch.softmax(logits, -1), K, dim=-1).indices
        mlp = layers[i].mlp
        s = torch.sigmoid(logits) + mlp.gate.e_score_correction_bias.float()
        ng, tg = cfg.n_group, cfg.topk_group
        gs = s.view(-1, ng, E // ng).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(tg, dim=-1).indices, 1)
        mask = keep.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
        return torch.topk(s.masked_fill(mask == 0, 0.0), K, dim=-1).indices

    def gate_hook(i):
        def hook(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            with torch.no_grad():
                idx = select(i, logits.reshape(-1, E))
                counts[i] += torch.bincount(idx.reshape(-1), minlength=E).double()
                if i not in inputs_seen:
                    x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                    m = x.mean(0)
                    cos = torch.nn.functional.cosine_similarity(x, m.unsqueeze(0), dim=-1).mean().item()
                    common = (x @ m / m.norm()).pow(2).sum() / x.pow(2).sum()
                    inputs_seen[i] = (cos, common.item())
        return hook

    for i in moe_layers:
        layers[i].mlp.gate.register_forward_hook(gate_hook(i))

    tokens = read_tokens(a.tokens)
    n_train = int(len(tokens) * 0.99) - a.seq_len - 1
    rng = np.random.default_rng(a.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def lr_at(step):  # moefold's schedule: linear warmup to lr, cosine to min_lr over schedule-steps
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        p = min(1.0, (step - a.warmup) / max(1, a.schedule_steps - a.warmup))
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * p))

    micro = a.global_batch // a.micro_batch
    for step in range(a.steps):
        t0 = time.time()
        for c in counts.values():
            c.zero_()
        lm = aux = 0.0
        for _ in range(micro):
            starts = rng.integers(0, n_train, a.micro_batch)
            ids = torch.tensor(np.stack([tokens[s:s + a.seq_len + 1] for s in starts]), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids[:, :-1])
            ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                                   ids[:, 1:].reshape(-1))
            loss = ce
            if family == "qwen3_moe":
                loss = loss + cfg.router_aux_loss_coef * out.aux_loss
                aux += float(out.aux_loss) / micro
            (loss / micro).backward()
            lm += float(ce) / micro
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if family != "qwen3_moe" and a.bias_rate > 0:
            with torch.no_grad():
                for i in moe_layers:
                    c = counts[i]
                    layers[i].mlp.gate.e_score_correction_bias += a.bias_rate * torch.sign(c.mean() - c).float()
        loads = {str(i): round((counts[i].max() / counts[i].mean()).item(), 3) for i in moe_layers}
        row = {"label": a.label, "step": step + 1, "loss": round(lm, 4), "aux": round(aux, 6), "grad_norm": round(gn, 3),
               "max_over_mean": loads, "s": round(time.time() - t0, 2)}
        if step == 0:
            row["router_input_cos_to_mean"] = {str(i): round(v[0], 4) for i, v in inputs_seen.items()}
            row["router_input_common_energy"] = {str(i): round(v[1], 4) for i, v in inputs_seen.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
