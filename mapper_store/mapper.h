// One mapper directory (manifest.yaml + weights.safetensors + SHA256SUMS): loading with full
// validation into host memory, the MapperView the backends consume, and atomic writing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/host_buffer.h"
#include "kernels/mapper_view.h"
#include "mapper_store/format/manifest.h"
#include "safetensors/safetensors.h"

namespace kvt {

// Tensors whose names start with this are optional extras (e.g. "stats.source.3.k.mean" for
// input-shift detection, a later feature); the loader keeps them but does not interpret them.
inline constexpr char kStatsTensorPrefix[] = "stats.";

// "layers.{l}.k.weight" and friends.
std::string MapperTensorName(int target_layer, char kv /* 'k' or 'v' */, bool bias);

// "layers.{l}.k.fc2.bias" and friends: layer `fc` (1, 2 or 3) of an MLP mapper's K or V chain.
std::string MlpTensorName(int target_layer, char kv /* 'k' or 'v' */, int fc, bool bias);

// The tensors a manifest requires, in canonical file order, with their shapes and the
// manifest's dtype. Ridge (per target layer: k.weight, k.bias, v.weight, v.bias):
//   layers.{l}.k.weight [len(sigma_k) * n_s * d_s, n_t * d_t]   layers.{l}.k.bias [n_t * d_t]
//   layers.{l}.v.weight [len(sigma_v) * n_s * d_s, n_t * d_t]   layers.{l}.v.bias [n_t * d_t]
// MLP (per target layer, k then v, fc1.weight, fc1.bias, fc2..., fc3...; in = len(sigma) n_s d_s,
// H = mlp.hidden, out = n_t d_t):
//   per_layer: fc1 [in, H] + [H], fc2 [H, H] + [H], fc3 [H, out] + [out]
//   per_head:  fc1 [n_t, in, H] + [n_t, H], fc2 [n_t, H, H] + [n_t, H],
//              fc3 [n_t, H, d_t] + [n_t, d_t]
std::vector<TensorSpec> MapperTensorSpecs(const Manifest& manifest);
// The distinct GEMM shapes (k x n of each weight matrix, a per-head stack counted once per head)
// those tensors give the backends: what the CPU backend's `cpu_gemm: auto` times.
std::vector<GemmShape> MapperGemmShapes(const Manifest& manifest);
// Total bytes and parameters of those tensors.
uint64_t MapperWeightBytes(const Manifest& manifest);
int64_t MapperNumParams(const Manifest& manifest);

// Checks that `tensors` are exactly what `manifest` requires, plus any "stats." extras:
// "missing tensor 'layers.3.v.bias'", "extra tensor 'foo'", "tensor ... has shape [..] but the
// manifest requires [..]", "tensor ... has dtype F16 but weights.dtype is bf16". INVALID_ARGUMENT.
absl::Status ValidateMapperTensors(const Manifest& manifest, const std::vector<TensorSpec>& tensors);

// A tensor as the backends see it: every dimension but the last folds into rows (an MLP's
// per_head [n_t, a, b] tensor is the (n_t a) x b stack MlpView describes, its [n_t, b] bias
// n_t x b).
WeightView TensorWeightView(const TensorSpec& spec, const void* data);

// The MapperView of `manifest` over its tensors, found by name through `tensor` (every name of
// MapperTensorSpecs(manifest), already validated by ValidateMapperTensors). Used by
// LoadMapperDir and by in-memory mappers (synth.h).
MapperView BuildMapperView(const Manifest& manifest,
                           const std::function<WeightView(const std::string& name)>& tensor);

struct LoadOptions {
  // Check SHA256SUMS (required when true). The weights are hashed while they are read, so this
  // costs CPU time but no second pass over the file.
  bool verify_checksums = true;
  // Host memory for the weights; empty = pageable aligned memory (a CUDA build passes pinned).
  HostAllocator allocator;
};

// A validated mapper in host memory. Immutable after loading, so it is shared freely between
// threads; view() points into weights() and is valid as long as this object lives.
class LoadedMapper {
 public:
  // The directory name: how requests and ListMappers refer to it.
  const std::string& id() const { return id_; }
  const std::string& path() const { return path_; }
  const Manifest& manifest() const { return manifest_; }
  const MapperView& view() const { return view_; }
  const SafetensorsFile& weights() const { return *weights_; }
  // Host bytes held: the whole data section of the weights file (mapping tensors and extras).
  uint64_t weight_bytes() const { return weights_->data_size(); }
  // Parameters of the mapping tensors (W and b, or the MLP chains; K and V, every target layer).
  int64_t num_params() const { return MapperNumParams(manifest_); }
  // False when loaded with verify_checksums = false.
  bool checksums_verified() const { return checksums_verified_; }
  // SHA-256 (hex) of the weights file as SHA256SUMS lists it and the read verified; empty when
  // loaded with verify_checksums = false. Identifies the weights across reloads (e.g. live
  // verification's mapper version).
  const std::string& weights_sha256() const { return weights_sha256_; }

 private:
  friend absl::StatusOr<std::unique_ptr<LoadedMapper>> LoadMapperDir(const std::string&,
                                                                      const LoadOptions&);
  LoadedMapper() = default;

  std::string id_;
  std::string path_;
  Manifest manifest_;
  std::unique_ptr<SafetensorsFile> weights_;
  MapperView view_;
  bool checksums_verified_ = false;
  std::string weights_sha256_;
};

// Loads and validates a mapper directory. Order: SHA256SUMS parsed (NOT_FOUND if missing);
// manifest.yaml checked against it (DATA_LOSS "checksum mismatch for manifest.yaml ..."), then
// parsed (errors name key and line); weights read and hashed (DATA_LOSS on a truncated file or a
// checksum mismatch naming the file); tensors validated against the manifest (INVALID_ARGUMENT:
// missing / extra tensor, wrong shape, wrong dtype). Every message starts with the directory.
// Nothing is half-loaded: either a complete mapper or an error.
absl::StatusOr<std::unique_ptr<LoadedMapper>> LoadMapperDir(const std::string& dir,
                                                            const LoadOptions& options = {});

struct WriteOptions {
  // Replace an existing directory at the destination (else ALREADY_EXISTS).
  bool overwrite = false;
};

// Writes manifest.yaml, the weights file and SHA256SUMS into a temporary sibling directory
// (".<name>.tmp-...", which MapperStore::Scan skips), fsyncs them, then renames it to `dir`, so a
// store scanning concurrently sees either no mapper or a complete one. Parent directories are
// created. The manifest and the tensor list are validated before anything is written.
absl::Status WriteMapperDir(const std::string& dir, const Manifest& manifest,
                            const std::vector<TensorRef>& tensors, const WriteOptions& options = {});
// Same, producing tensor data one tensor at a time (multi-GB mappers without holding them).
absl::Status WriteMapperDir(const std::string& dir, const Manifest& manifest,
                            const std::vector<TensorSpec>& specs, const TensorFiller& fill,
                            const WriteOptions& options = {});

// Rewrites only manifest.yaml (as `manifest`) and its SHA256SUMS line in the directory `mapper`
// was loaded from, keeping every other file byte for byte (`kvt record-benefit`: weights can be
// GBs). A hidden sibling gets the two new files and hard links to the others, then replaces the
// directory as WriteMapperDir does, so a store scanning concurrently sees the old mapper or the
// new one, never a manifest that disagrees with SHA256SUMS. `mapper` must have been loaded with
// checksums verified; `manifest` must validate and describe the loaded tensors under the same
// weights.file. On any error the directory is untouched.
absl::Status RewriteMapperManifest(const LoadedMapper& mapper, const Manifest& manifest);

}  // namespace kvt
