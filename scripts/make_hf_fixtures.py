#!/usr/bin/env python3
"""Generates the Hugging Face parity fixtures under tests/fixtures/hf/ (issue 6).

Needs torch and transformers (`pip install torch transformers` on any machine; CI does not: it
reads the committed fixtures). For each tiny random configuration it writes DIR/<name>/ with the
model as `save_pretrained` writes it (config.json, model.safetensors), inputs.npy (2-D int32, one
sequence per row), logits.npy (float32 [rows, cols, vocab], transformers' logits for those
sequences) and expected.json (transformers' mean next-token loss, fp32, and the versions). For
the names in BF16_COPIES it also writes <name>_bf16/ (config.json, model.safetensors in bfloat16)
for the bit-exact round trip of a bfloat16 checkpoint.
Usage: python3 scripts/make_hf_fixtures.py OUT_DIR [NAME ...]

Sizes keep every width a multiple of 4 floats: transformers' CPU grouped_mm needs 16-byte strides.
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
              output_router_logits=False)


def qwen3_moe(**kw):
    base = dict(intermediate_size=32, rope_theta=10000.0, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**COMMON, **base, **kw}))


def mixtral(**kw):
    return MixtralForCausalLM(MixtralConfig(**{**COMMON, "rope_theta": 1e6, "router_aux_loss_coef": 0.0, **kw}))


def olmoe(**kw):
    return OlmoeForCausalLM(OlmoeConfig(**{**COMMON, "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, **kw}))


def deepseek_v3(**kw):
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{**COMMON, **kw}))


CONFIGS = {
    # Qwen3-MoE: odd head counts, experts not a power of two, top-k renormalised or not
    "qwen3_moe_a": lambda: qwen3_moe(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
                                     num_key_value_heads=2, head_dim=8, moe_intermediate_size=12, num_experts=6,
                                     num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3_moe_b": lambda: qwen3_moe(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=3,
                                     num_key_value_heads=3, head_dim=6, moe_intermediate_size=8, num_experts=5,
                                     num_experts_per_tok=3, norm_topk_prob=False),
    # two dense layers (mlp_only_layers) among four
    "qwen3_moe_dense": lambda: qwen3_moe(vocab_size=37, hidden_size=20, num_hidden_layers=4, num_attention_heads=5,
                                         num_key_value_heads=1, head_dim=4, moe_intermediate_size=8, num_experts=3,
                                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0, 2],
                                         intermediate_size=28),
    # Mixtral: grouped-query attention, softmax top-2 (renormalised)
    "mixtral_a": lambda: mixtral(vocab_size=53, hidden_size=24, intermediate_size=16, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, num_local_experts=5,
                                 num_experts_per_tok=2),
    "mixtral_b": lambda: mixtral(vocab_size=40, hidden_size=12, intermediate_size=20, num_hidden_layers=3,
                                 num_attention_heads=3, num_key_value_heads=1, num_local_experts=3,
                                 num_experts_per_tok=2, head_dim=4),
    # OLMoE: q/k norms over the whole projection, top-k without renormalisation
    "olmoe_a": lambda: olmoe(vocab_size=59, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=6, num_experts=7, num_experts_per_tok=3,
                             norm_topk_prob=False),
    "olmoe_b": lambda: olmoe(vocab_size=45, hidden_size=20, intermediate_size=8, num_hidden_layers=3,
                             num_attention_heads=5, num_key_value_heads=1, num_experts=6, num_experts_per_tok=4,
                             norm_topk_prob=True),
    # DeepSeek-V3: MLA without q-LoRA, YaRN, interleaved RoPE, groups, shared expert, 2 dense layers
    "deepseek_v3_a": lambda: deepseek_v3(
        vocab_size=57, hidden_size=24, intermediate_size=28, moe_intermediate_size=8, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1, n_routed_experts=6, routed_scaling_factor=2.5,
        kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=3,
        topk_group=2, num_experts_per_tok=3, first_k_dense_replace=2, norm_topk_prob=True, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # DeepSeek-V3: q-LoRA, plain RoPE not interleaved, no groups, two shared experts, top-k not renormalised
    "deepseek_v3_b": lambda: deepseek_v3(
        vocab_size=43, hidden_size=16, intermediate_size=20, moe_intermediate_size=4, num_hidden_layers=3,
        num_attention_heads=5, num_key_value_heads=5, n_shared_experts=2, n_routed_experts=5, routed_scaling_factor=1.0,
        kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=6, v_head_dim=4, qk_nope_head_dim=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=False, rope_interleave=False,
        rope_parameters=dict(rope_type="default", rope_theta=500.0)),
}

BF16_COPIES = {"deepseek_v3_b", "mixtral_b"}


def main(out, names):
    for name in names or CONFIGS:
        torch.manual_seed(0)
        model = CONFIGS[name]().float().eval()
        with torch.no_grad():  # larger weights than the default init, so every path matters
            for pname, p in model.named_parameters():
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):  # selection bias: changes the choice
                    b.uniform_(0.0, 0.3)
        d = os.path.join(out, name)
        model.save_pretrained(d, safe_serialization=True)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            res = model(input_ids=ids, labels=ids)
        np.save(os.path.join(d, "inputs.npy"), ids.numpy().astype(np.int32))
        np.save(os.path.join(d, "logits.npy"), res.logits.float().numpy())
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump({"loss": res.loss.item(), "transformers": transformers.__version__, "torch": torch.__version__},
                      f, indent=1)
        os.remove(os.path.join(d, "generation_config.json"))
        if name in BF16_COPIES:  # a bfloat16 checkpoint for the export(import(x)) == x round trip
            b = os.path.join(out, name + "_bf16")
            # loaded as a user would (transformers keeps the selection bias in float32)
            transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(b)
            os.remove(os.path.join(b, "generation_config.json"))
        print(name, res.loss.item(), sorted(os.listdir(d)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
