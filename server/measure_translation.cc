#include "server/measure_translation.h"

#include <memory>

#include "absl/strings/str_cat.h"

namespace kvt {

absl::Status MeasureTranslation(const MapperHandle& mapper, const ComputeMapper& compute,
                                const MeasureInputs& in, absl::Time deadline,
                                const std::function<bool()>& cancelled,
                                std::vector<LayerQuality>* layers) {
  const MapperView& view = mapper.mapper().view();
  const ModelSpec& tgt = view.target;
  const int64_t T = in.source.num_tokens;
  if (in.truth.num_tokens != T || static_cast<int>(in.truth.k.size()) != tgt.num_layers ||
      static_cast<int>(in.truth.v.size()) != tgt.num_layers ||
      in.truth.num_kv_heads != tgt.num_kv_heads || in.truth.head_dim != tgt.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the target's own cache (", in.truth.k.size(), " layers, ", in.truth.num_kv_heads,
        " heads, head_dim ", in.truth.head_dim, ", ", in.truth.num_tokens,
        " tokens) does not match mapper '", mapper.mapper().id(), "' target ", tgt.name, " (",
        tgt.num_layers, " layers, ", tgt.num_kv_heads, " heads, head_dim ", tgt.head_dim,
        ") over ", T, " tokens"));
  }
  absl::StatusOr<Rope> target_rope = Rope::Create(tgt.rope, tgt.head_dim);
  if (!target_rope.ok()) return target_rope.status();
  const DType out_dtype = in.truth.dtype;
  const int64_t floats = static_cast<int64_t>(tgt.num_kv_heads) * T * tgt.head_dim;
  const size_t layer_bytes = static_cast<size_t>(floats) * DTypeSize(out_dtype);
  std::unique_ptr<char[]> mapped_k(new char[layer_bytes]), mapped_v(new char[layer_bytes]);
  MutableCacheView target;
  target.dtype = out_dtype;
  target.layout = Layout::kNHD;
  target.num_kv_heads = tgt.num_kv_heads;
  target.head_dim = tgt.head_dim;
  target.num_tokens = T;
  const int num_query_heads = in.queries.num_kv_heads;
  std::vector<float> k_mapped(floats), v_mapped(floats), k_true(floats), v_true(floats),
      q(static_cast<size_t>(num_query_heads) * T * tgt.head_dim);
  layers->assign(tgt.num_layers, LayerQuality{});
  for (int layer = 0; layer < tgt.num_layers; ++layer) {
    if (cancelled && cancelled()) return absl::CancelledError("client went away");
    target.k.assign(tgt.num_layers, nullptr);
    target.v.assign(tgt.num_layers, nullptr);
    target.k[layer] = mapped_k.get();
    target.v[layer] = mapped_v.get();
    // A cold page-in streams per layer: this layer's weights may still be arriving.
    absl::Status status = mapper.WaitLayerReady(layer, deadline);
    if (status.ok()) {
      status = compute.backend->TranslateLayer(*compute.prepared, layer, in.source,
                                               in.positions, in.options, &target);
    }
    if (!status.ok()) return status;
    ToTokenMajorFloat(out_dtype, Layout::kNHD, tgt.num_kv_heads, T, tgt.head_dim,
                      mapped_k.get(), k_mapped.data());
    ToTokenMajorFloat(out_dtype, Layout::kNHD, tgt.num_kv_heads, T, tgt.head_dim,
                      mapped_v.get(), v_mapped.data());
    ToTokenMajorFloat(in.truth.dtype, in.truth.layout, tgt.num_kv_heads, T, tgt.head_dim,
                      in.truth.k[layer], k_true.data());
    ToTokenMajorFloat(in.truth.dtype, in.truth.layout, tgt.num_kv_heads, T, tgt.head_dim,
                      in.truth.v[layer], v_true.data());
    LayerQualityInputs quality_in;
    quality_in.num_tokens = T;
    quality_in.num_kv_heads = tgt.num_kv_heads;
    quality_in.head_dim = tgt.head_dim;
    quality_in.k_mapped = k_mapped.data();
    quality_in.v_mapped = v_mapped.data();
    quality_in.k_true = k_true.data();
    quality_in.v_true = v_true.data();
    quality_in.cosines_only = in.cosines_only;
    if (num_query_heads > 0) {
      ToTokenMajorFloat(in.queries.dtype, in.queries.layout, num_query_heads, T, tgt.head_dim,
                        in.queries.k[layer], q.data());
      quality_in.num_query_heads = num_query_heads;
      quality_in.queries = q.data();
    }
    absl::StatusOr<LayerQuality> quality =
        ComputeLayerQuality(quality_in, *target_rope, in.positions);
    if (!quality.ok()) return quality.status();
    (*layers)[layer] = *quality;
  }
  return absl::OkStatus();
}

}  // namespace kvt
