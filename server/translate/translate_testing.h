// Test parts for the TranslateKV steps (testonly): a real mapper store holding one synthetic
// mapper (mapper_store/synth "demo-tiny": 4 -> 6 layers, 2 KV heads x 32, k=2, fp32) with the
// real CPU backend as its device, headers for it, random source caches, inline chunk messages,
// and the translation computed directly by the backend to compare with bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "proto/kvt/v1/translate.pb.h"
#include "server/config.h"
#include "server/translate/request_plan.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace testing {

constexpr char kTinyMapper[] = "tiny";

class TinyStore {
 public:
  TinyStore();
  ~TinyStore();
  MapperStore* store() { return store_.get(); }
  Backend* backend() { return backend_.get(); }
  KvtdConfig& config() { return config_; }
  PlanContext context() { return PlanContext{&config_, store_.get(), nullptr}; }
  const MapperView& view();
  // PlanTranslate of `header` against this store, no deadline; a failure is a test failure
  // (and the plan returned is then empty).
  TranslatePlan Plan(const v1::TranslateHeader& header);

 private:
  KvtdConfig config_;
  std::unique_ptr<Backend> backend_;  // outlives the store, whose device it is
  std::unique_ptr<MapperStore> store_;
  std::shared_ptr<const LoadedMapper> mapper_;
};

// An fp32 header for the tiny mapper, inline both ways.
v1::TranslateHeader TinyHeader(int64_t num_tokens, v1::Layout layout = v1::LAYOUT_NHD);

// One cache as whole-layer byte strings, K and V per layer.
struct Layers {
  std::vector<std::string> k, v;
  std::string& at(int layer, int kind) { return kind == 0 ? k[layer] : v[layer]; }
};
// fp32 N(0, 1) values, `layers` layers of `geometry`.
Layers RandomLayers(int layers, const LayerGeometry& geometry, uint64_t seed);
// A view over `layers`.
CacheView ViewOf(const Layers& layers, DType dtype, const LayerGeometry& geometry);
// The same cache packed layer-major, K then V per layer (a packed region's bytes).
std::string Packed(const Layers& layers);

// Inline chunk messages of an NHD cache: every layer K then V, `tokens_per_chunk` tokens each.
// The chunk bytes point into `layers` (keep it alive).
std::vector<TranslateRequestMessage> ChunkMessages(const Layers& layers,
                                                   const LayerGeometry& geometry,
                                                   int64_t tokens_per_chunk);
// A reader over `messages` (moved out as they are read).
RequestReader ReaderOf(std::vector<TranslateRequestMessage>* messages);

// Every target layer computed directly: PinOnDevice, then Backend::TranslateLayer per layer.
Layers DirectTranslate(MapperStore* store, const CacheView& source, const Positions& positions,
                       DType dtype, Layout layout, const TranslateOptions& options);

}  // namespace testing
}  // namespace kvt
