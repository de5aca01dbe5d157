// Hugging Face interoperability (issue 6, first part): a model directory as `save_pretrained`
// writes it (config.json, model.safetensors or shards with model.safetensors.index.json) into a
// moefold run directory whose step-0 checkpoint `moefold train --resume` continues from.
// And back: a checkpoint into such a directory. Supported architectures: Qwen3MoeForCausalLM,
// MixtralForCausalLM, OlmoeForCausalLM, DeepseekV3ForCausalLM (model.architecture qwen3_moe,
// mixtral, olmoe, deepseek_v3).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"

namespace moefold {

// The [model] and [moe] sections from HF_DIR/config.json (other sections: the tiny preset's);
// Error naming the file and key for unsupported architectures or features.
Config config_from_hf(const std::string& hf_dir);

// Every parameter from the directory's safetensors (single file or sharded with its index), by
// Hugging Face name; fails naming the file and tensor when one is missing, extra or misshapen.
// float32_names (optional) receives the names (without "model.layers.N.") of float32 tensors.
void load_hf_weights(const std::string& hf_dir, std::vector<Param>& params,
                     std::vector<std::string>* float32_names = nullptr);

// Multi-token-prediction layers present in the directory's tensors (DeepSeek-V3 stores them as
// layers num_hidden_layers, num_hidden_layers + 1, ...; transformers drops them).
int64_t hf_mtp_depth(const std::string& hf_dir, int64_t num_hidden_layers);

// `moefold convert --from-hf HF_DIR --to RUN_DIR`: RUN_DIR/config.toml and
// RUN_DIR/checkpoints/step_00000000 (weights, zero optimizer state). Returns the checkpoint path.
std::string import_hf(const std::string& hf_dir, const std::string& run_dir);

// The config.json of a config (its family's keys). Error when the family cannot express it
// (e.g. shared experts in a Mixtral config).
nlohmann::json config_to_hf(const Config& cfg);

// `moefold convert --from CKPT_DIR --to-hf HF_DIR`: config.json and model.safetensors with the
// checkpoint's weights under their Hugging Face names, in model.torch_dtype (the selection bias
// e_score_correction_bias stays fp32, as transformers keeps it).
void export_hf(const std::string& ckpt_dir, const std::string& hf_dir);

}  // namespace moefold
