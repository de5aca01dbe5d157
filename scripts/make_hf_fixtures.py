#!/usr/bin/env python3
"""Generates the Hugging Face parity fixtures under tests/fixtures/hf/ (issue 6).

Needs torch and transformers (the H200 machines have them; CI does not: it reads the committed
fixtures). For each tiny random configuration it writes DIR/<name>/ with the model as
`save_pretrained` writes it (config.json, model.safetensors), inputs.npy (2-D int32, one sequence
per row) and expected.json (transformers' mean next-token loss over those sequences, fp32).
Usage: python3 scripts/make_hf_fixtures.py OUT_DIR
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CONFIGS = {
    # odd head counts, experts not a power of two, top-k renormalised or not
    "qwen3_moe_a": dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
                        num_key_value_heads=2, head_dim=8, moe_intermediate_size=12, num_experts=6,
                        num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3_moe_b": dict(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=3,
                        num_key_value_heads=3, head_dim=6, moe_intermediate_size=8, num_experts=5,
                        num_experts_per_tok=3, norm_topk_prob=False),
}


def main(out):
    torch.manual_seed(0)
    for name, kw in CONFIGS.items():
        cfg = Qwen3MoeConfig(intermediate_size=32, max_position_embeddings=64, rope_theta=10000.0,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
                             mlp_only_layers=[], router_aux_loss_coef=0.0, output_router_logits=False,
                             attention_bias=False, **kw)
        model = Qwen3MoeForCausalLM(cfg).float().eval()
        with torch.no_grad():  # larger weights than the default init, so every path matters
            for p in model.parameters():
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        d = os.path.join(out, name)
        model.save_pretrained(d, safe_serialization=True)
        ids = torch.randint(0, kw["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        np.save(os.path.join(d, "inputs.npy"), ids.numpy().astype(np.int32))
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump({"loss": loss, "transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)
        print(name, loss, sorted(os.listdir(d)))


if __name__ == "__main__":
    main(sys.argv[1])
