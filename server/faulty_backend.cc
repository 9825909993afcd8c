#include "server/faulty_backend.h"

#include <utility>

#include "kernels/dtype.h"

namespace kvt {
namespace testing {
namespace {

class FaultyBackend : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, const FaultyBackendOptions& options)
      : inner_(std::move(inner)), options_(options) {}

  std::string name() const override { return options_.name; }
  std::string device() const override { return options_.device; }

  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override {
    if (options_.fault == Fault::kPrepareError) {
      return absl::ResourceExhaustedError(options_.error_message);
    }
    return inner_->Prepare(mapper);
  }
  absl::StatusOr<std::shared_ptr<PreparedMapper>> BeginPrepare(const MapperView& mapper) override {
    if (options_.fault == Fault::kPrepareError) {
      return absl::ResourceExhaustedError(options_.error_message);
    }
    return inner_->BeginPrepare(mapper);
  }
  absl::Status PrepareLayer(PreparedMapper& prepared, int target_layer) override {
    return inner_->PrepareLayer(prepared, target_layer);
  }

  absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target) override {
    if (options_.fault == Fault::kTranslateError) {
      return absl::InternalError(options_.error_message);
    }
    absl::Status status =
        inner_->TranslateLayer(mapper, target_layer, source, positions, options, target);
    if (status.ok() && options_.fault == Fault::kPerturb) {
      void* k = target->k[target_layer];
      StoreFromDouble(target->dtype, k, 0, LoadAsDouble(target->dtype, k, 0) + options_.offset);
    }
    return status;
  }

 private:
  std::unique_ptr<Backend> inner_;
  const FaultyBackendOptions options_;
};

}  // namespace

std::unique_ptr<Backend> NewFaultyBackend(std::unique_ptr<Backend> inner,
                                          const FaultyBackendOptions& options) {
  return std::make_unique<FaultyBackend>(std::move(inner), options);
}

}  // namespace testing
}  // namespace kvt
