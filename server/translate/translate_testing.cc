#include "server/translate/translate_testing.h"

#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace testing {

TinyStore::TinyStore() {
  const std::string root = MakeTempDir("translate-store");
  absl::StatusOr<SynthOptions> options = SynthPreset("demo-tiny");
  EXPECT_TRUE(options.ok()) << options.status();
  KVT_EXPECT_OK(WriteSynthMapper(root + "/" + kTinyMapper, *options));
  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root);
  EXPECT_TRUE(store.ok()) << store.status();
  store_ = std::move(*store);
  backend_ = NewCpuBackend();
  KVT_EXPECT_OK(store_->AddDevice({backend_.get(), 0}));
  config_.shared_memory.allow_client_regions = true;
}

TinyStore::~TinyStore() {
  mapper_.reset();
  store_.reset();
}

const MapperView& TinyStore::view() {
  if (mapper_ == nullptr) {
    absl::StatusOr<std::shared_ptr<const LoadedMapper>> mapper = store_->Get(kTinyMapper);
    EXPECT_TRUE(mapper.ok()) << mapper.status();
    mapper_ = *mapper;
  }
  return mapper_->view();
}

TranslatePlan TinyStore::Plan(const v1::TranslateHeader& header) {
  PairLabels pair = PairLabels::Unknown();
  absl::StatusOr<TranslatePlan> plan =
      PlanTranslate(header, context(), absl::InfiniteFuture(), &pair);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? std::move(*plan) : TranslatePlan();
}

v1::TranslateHeader TinyHeader(int64_t num_tokens, v1::Layout layout) {
  v1::TranslateHeader header;
  header.set_mapper_id(kTinyMapper);
  header.set_dtype(v1::DTYPE_FP32);
  header.set_layout(layout);
  header.set_num_tokens(static_cast<uint32_t>(num_tokens));
  header.mutable_input()->mutable_inline_();
  header.mutable_output()->mutable_inline_();
  return header;
}

Layers RandomLayers(int layers, const LayerGeometry& geometry, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Layers out;
  for (int l = 0; l < layers; ++l) {
    for (std::vector<std::string>* kind : {&out.k, &out.v}) {
      std::string bytes(static_cast<size_t>(geometry.layer_bytes()), '\0');
      float* values = reinterpret_cast<float*>(&bytes[0]);
      for (size_t i = 0; i < bytes.size() / sizeof(float); ++i) values[i] = normal(rng);
      kind->push_back(std::move(bytes));
    }
  }
  return out;
}

CacheView ViewOf(const Layers& layers, DType dtype, const LayerGeometry& geometry) {
  CacheView view;
  view.dtype = dtype;
  view.layout = geometry.layout;
  view.num_kv_heads = static_cast<int>(geometry.num_heads);
  view.head_dim = static_cast<int>(geometry.head_dim);
  view.num_tokens = geometry.num_tokens;
  for (size_t l = 0; l < layers.k.size(); ++l) {
    view.k.push_back(layers.k[l].data());
    view.v.push_back(layers.v[l].data());
  }
  return view;
}

std::string Packed(const Layers& layers) {
  std::string packed;
  for (size_t l = 0; l < layers.k.size(); ++l) packed += layers.k[l] + layers.v[l];
  return packed;
}

std::vector<TranslateRequestMessage> ChunkMessages(const Layers& layers,
                                                   const LayerGeometry& geometry,
                                                   int64_t tokens_per_chunk) {
  std::vector<TranslateRequestMessage> messages;
  for (size_t l = 0; l < layers.k.size(); ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::string& layer = kind == 0 ? layers.k[l] : layers.v[l];
      for (int64_t first = 0; first < geometry.num_tokens; first += tokens_per_chunk) {
        const int64_t count = std::min(tokens_per_chunk, geometry.num_tokens - first);
        TranslateRequestMessage message;
        v1::KVChunk* chunk = message.proto.mutable_chunk();
        chunk->set_layer(static_cast<uint32_t>(l));
        chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
        chunk->set_token_start(static_cast<uint32_t>(first));
        chunk->set_token_count(static_cast<uint32_t>(count));
        // NHD: a token range is one contiguous span of the layer.
        message.data = ChunkBytes({absl::string_view(layer.data() + geometry.chunk_bytes(first),
                                                     geometry.chunk_bytes(count))},
                                  nullptr);
        messages.push_back(std::move(message));
      }
    }
  }
  return messages;
}

RequestReader ReaderOf(std::vector<TranslateRequestMessage>* messages) {
  auto next = std::make_shared<size_t>(0);
  return [messages, next](TranslateRequestMessage* message) {
    if (*next >= messages->size()) return false;
    *message = std::move((*messages)[(*next)++]);
    return true;
  };
}

Layers DirectTranslate(MapperStore* store, const CacheView& source, const Positions& positions,
                       DType dtype, Layout layout, const TranslateOptions& options) {
  Layers out;
  absl::StatusOr<MapperHandle> handle = store->Acquire(kTinyMapper, AcquireOptions());
  EXPECT_TRUE(handle.ok()) << handle.status();
  AcquireOptions on_device;
  on_device.device = "any";
  KVT_EXPECT_OK(store->PinOnDevice(&*handle, on_device));
  const ModelSpec& target = handle->mapper().view().target;
  const LayerGeometry geometry{layout, target.num_kv_heads, source.num_tokens, target.head_dim,
                               static_cast<int64_t>(DTypeSize(dtype))};
  MutableCacheView view;
  view.dtype = dtype;
  view.layout = layout;
  view.num_kv_heads = target.num_kv_heads;
  view.head_dim = target.head_dim;
  view.num_tokens = source.num_tokens;
  for (int l = 0; l < target.num_layers; ++l) {
    out.k.emplace_back(static_cast<size_t>(geometry.layer_bytes()), '\0');
    out.v.emplace_back(static_cast<size_t>(geometry.layer_bytes()), '\0');
  }
  for (int l = 0; l < target.num_layers; ++l) {
    view.k.assign(target.num_layers, nullptr);
    view.v.assign(target.num_layers, nullptr);
    view.k[l] = &out.k[l][0];
    view.v[l] = &out.v[l][0];
    KVT_EXPECT_OK(
        handle->backend()->TranslateLayer(*handle->prepared(), l, source, positions, options, &view));
  }
  return out;
}

}  // namespace testing
}  // namespace kvt
