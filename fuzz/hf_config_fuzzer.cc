// Fuzz target: ParseHfConfig (Hugging Face config.json for `kvt fit`). An accepted config
// yields a model shape the rest of kvt can use: positive sizes and a RoPE config that validates.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "kernels/rope.h"
#include "mapper_store/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvt::ModelSpec> model = kvt::ParseHfConfig(text, "config.json", "fuzz/model");
  if (!model.ok()) {
    FUZZ_CHECK(!model.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(model->num_layers > 0);
  FUZZ_CHECK(model->num_kv_heads > 0);
  FUZZ_CHECK(model->head_dim > 0);
  FUZZ_CHECK(kvt::ValidateRopeConfig(model->rope, model->head_dim).ok());
  return 0;
}
