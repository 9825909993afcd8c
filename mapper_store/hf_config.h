// Hugging Face config.json -> ModelSpec (layers, KV heads, head_dim, RoPE) for `kvt fit` and
// `kvt import`.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/mapper_view.h"

namespace kvt {

// Reads the keys SPEC 2 needs from a Hugging Face config.json text:
//   num_hidden_layers; num_key_value_heads (absent: num_attention_heads, i.e. no GQA);
//   head_dim (absent or null: hidden_size / num_attention_heads); rope_theta (default 10000);
//   partial_rotary_factor (default 1: rotary_dim = head_dim * factor, rounded down to even);
//   rope_scaling (null, or rope_type/type default|linear|llama3|yarn with their parameters;
//   yarn's original_max_position_embeddings falls back to max_position_embeddings).
// Multimodal wrappers that nest the language model under "text_config" are read from there, and
// transformers 5's "rope_parameters" is accepted in place of rope_theta + rope_scaling.
// RoPE style is neox (rotate_half), which every supported family uses.
// Read with common/strict_reader.h's JsonReader: errors are INVALID_ARGUMENT "<label>: ..."
// naming the key by its full path ("key 'text_config.head_dim' must be a positive integer, got
// 0", "missing required key 'num_hidden_layers'"); unsupported scaling types (dynamic, longrope,
// mrope, ...) are refused naming the type. Keys kvt does not read are ignored.
// `name`: the ModelSpec name; empty takes "_name_or_path" from the file.
absl::StatusOr<ModelSpec> ParseHfConfig(absl::string_view json_text, absl::string_view label,
                                        const std::string& name = "");
// Reads a file (or a model directory holding config.json); messages name the path.
absl::StatusOr<ModelSpec> ReadHfConfig(const std::string& path, const std::string& name = "");

}  // namespace kvt
