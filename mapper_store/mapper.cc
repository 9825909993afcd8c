#include "mapper_store/mapper.h"

#include <errno.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/file_util.h"

namespace kvt {
namespace {

// Prefixes "<dir>: " unless the message already names a path inside the directory.
absl::Status InDir(const std::string& dir, const absl::Status& status) {
  if (status.ok() || absl::StartsWith(status.message(), dir)) return status;
  return absl::Status(status.code(), absl::StrCat(dir, ": ", status.message()));
}

std::string NormalizeDir(const std::string& dir) {
  std::string out = dir;
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

absl::Status ChecksumMismatch(const std::string& file, const std::string& expected,
                              const std::string& actual) {
  return absl::DataLossError(absl::StrCat("checksum mismatch for ", file, ": SHA256SUMS says ",
                                          expected, " but the file hashes to ", actual,
                                          " (corrupt or partially copied)"));
}

// The shape message's prefix for a window mapper, whose input rows are `window` times wider.
std::string WindowNote(const Manifest& manifest) {
  return manifest.window == 1 ? std::string()
                              : absl::StrCat("window ", manifest.window, " x ");
}

// The shape-mismatch explanation of a ridge mapper's tensors.
std::string RidgeShapeWhy(const Manifest& m) {
  if (m.ridge_granularity == RidgeGranularity::kPerHead) {
    return absl::StrCat(
        WindowNote(m), "ridge.granularity per_head: [target.num_kv_heads ", m.target.num_kv_heads,
        ", len(sigma) x ", HeadLocalSources(m.source, m.target, 0).count,
        " matching source head(s) x source.head_dim ", m.source.head_dim,
        ", target.head_dim ", m.target.head_dim, "], bias [target.num_kv_heads, target.head_dim]");
  }
  return absl::StrCat(WindowNote(m), "rows = len(sigma) x source.num_kv_heads ",
                      m.source.num_kv_heads, " x source.head_dim ", m.source.head_dim,
                      ", cols = target.num_kv_heads ", m.target.num_kv_heads,
                      " x target.head_dim ", m.target.head_dim);
}

}  // namespace

std::string MapperTensorName(int target_layer, char kv, bool bias) {
  return absl::StrCat("layers.", target_layer, ".", std::string(1, kv), bias ? ".bias" : ".weight");
}

std::string MlpTensorName(int target_layer, char kv, int fc, bool bias) {
  return absl::StrCat("layers.", target_layer, ".", std::string(1, kv), ".fc", fc,
                      bias ? ".bias" : ".weight");
}

namespace {

// Head-local ridge: per target layer and K|V, the n_t heads' [window |sigma| g d_s, d_t]
// matrices stacked in a leading dimension, and an [n_t, d_t] bias.
std::vector<TensorSpec> HeadLocalTensorSpecs(const Manifest& m) {
  std::vector<TensorSpec> specs;
  const int64_t heads = m.target.num_kv_heads, dt = m.target.head_dim;
  for (const LayerEntry& layer : m.layers) {
    const int l = layer.target_layer;
    for (const auto& [kv, sigma] :
         {std::pair<char, const std::vector<int>*>{'k', &layer.sigma_k}, {'v', &layer.sigma_v}}) {
      const int64_t in = HeadLocalInputWidth(m.source, m.target, m.window, sigma->size());
      specs.push_back({MapperTensorName(l, kv, false), m.weights_dtype, {heads, in, dt}});
      specs.push_back({MapperTensorName(l, kv, true), m.weights_dtype, {heads, dt}});
    }
  }
  return specs;
}

}  // namespace

std::vector<TensorSpec> MapperTensorSpecs(const Manifest& m) {
  std::vector<TensorSpec> specs;
  // A window mapper reads every sigma block at `window` token offsets (offset-major).
  const int64_t in_per_layer =
      static_cast<int64_t>(m.window) * m.source.num_kv_heads * m.source.head_dim;
  const int64_t out = static_cast<int64_t>(m.target.num_kv_heads) * m.target.head_dim;
  if (m.kind == MapperKind::kMlp) {
    const MlpConfig config = m.mlp.value_or(MlpConfig());
    const int64_t hidden = config.hidden;
    const bool per_head = config.granularity == MlpGranularity::kPerHead;
    const int64_t heads = m.target.num_kv_heads;
    // per_head stacks one chain per target head in a leading dimension; head h's fc3 has d_t
    // columns instead of the layer's n_t d_t.
    const auto shape = [&](std::vector<int64_t> dims) {
      if (per_head) dims.insert(dims.begin(), heads);
      return dims;
    };
    const int64_t fc3_cols = per_head ? m.target.head_dim : out;
    for (const LayerEntry& layer : m.layers) {
      const int l = layer.target_layer;
      for (const auto& [kv, sigma] :
           {std::pair<char, const std::vector<int>*>{'k', &layer.sigma_k}, {'v', &layer.sigma_v}}) {
        const int64_t in = static_cast<int64_t>(sigma->size()) * in_per_layer;
        specs.push_back({MlpTensorName(l, kv, 1, false), m.weights_dtype, shape({in, hidden})});
        specs.push_back({MlpTensorName(l, kv, 1, true), m.weights_dtype, shape({hidden})});
        specs.push_back({MlpTensorName(l, kv, 2, false), m.weights_dtype, shape({hidden, hidden})});
        specs.push_back({MlpTensorName(l, kv, 2, true), m.weights_dtype, shape({hidden})});
        specs.push_back({MlpTensorName(l, kv, 3, false), m.weights_dtype, shape({hidden, fc3_cols})});
        specs.push_back({MlpTensorName(l, kv, 3, true), m.weights_dtype, shape({fc3_cols})});
      }
    }
    return specs;
  }
  if (m.ridge_granularity == RidgeGranularity::kPerHead) return HeadLocalTensorSpecs(m);
  for (const LayerEntry& layer : m.layers) {
    const int l = layer.target_layer;
    const int64_t in_k = static_cast<int64_t>(layer.sigma_k.size()) * in_per_layer;
    const int64_t in_v = static_cast<int64_t>(layer.sigma_v.size()) * in_per_layer;
    specs.push_back({MapperTensorName(l, 'k', false), m.weights_dtype, {in_k, out}});
    specs.push_back({MapperTensorName(l, 'k', true), m.weights_dtype, {out}});
    specs.push_back({MapperTensorName(l, 'v', false), m.weights_dtype, {in_v, out}});
    specs.push_back({MapperTensorName(l, 'v', true), m.weights_dtype, {out}});
  }
  return specs;
}

std::vector<GemmShape> MapperGemmShapes(const Manifest& manifest) {
  std::vector<GemmShape> shapes;
  for (const TensorSpec& spec : MapperTensorSpecs(manifest)) {
    // Matrices are [k, n] or a per-head stack [heads, k, n]; biases have one dimension fewer.
    const size_t dims = spec.shape.size();
    const bool matrix = absl::EndsWith(spec.name, ".weight") && dims >= 2;
    if (!matrix) continue;
    const GemmShape shape{spec.shape[dims - 2], spec.shape[dims - 1]};
    if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
  }
  return shapes;
}

uint64_t MapperWeightBytes(const Manifest& manifest) {
  return static_cast<uint64_t>(MapperNumParams(manifest)) * DTypeSize(manifest.weights_dtype);
}

int64_t MapperNumParams(const Manifest& manifest) {
  int64_t params = 0;
  for (const TensorSpec& spec : MapperTensorSpecs(manifest)) params += spec.num_elements();
  return params;
}

absl::Status ValidateMapperTensors(const Manifest& manifest, const std::vector<TensorSpec>& tensors) {
  std::map<std::string, const TensorSpec*> found;
  for (const TensorSpec& t : tensors) found[t.name] = &t;
  const std::vector<TensorSpec> expected = MapperTensorSpecs(manifest);
  std::set<std::string> expected_names;
  for (const TensorSpec& e : expected) expected_names.insert(e.name);
  std::vector<std::string> extra;
  for (const TensorSpec& t : tensors) {
    if (expected_names.count(t.name) == 0 && !absl::StartsWith(t.name, kStatsTensorPrefix)) {
      extra.push_back(absl::StrCat("'", t.name, "'"));
    }
  }
  std::vector<std::string> missing;
  for (const TensorSpec& e : expected) {
    auto it = found.find(e.name);
    if (it == found.end()) {
      missing.push_back(absl::StrCat("'", e.name, "'"));
      continue;
    }
    const TensorSpec& t = *it->second;
    if (t.dtype != e.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' has dtype ", SafetensorsDTypeName(t.dtype),
          " but the manifest's weights.dtype is ", DTypeName(e.dtype), " (",
          SafetensorsDTypeName(e.dtype), ")"));
    }
    if (t.shape != e.shape) {
      std::string why;
      if (manifest.kind == MapperKind::kMlp) {
        const MlpConfig config = manifest.mlp.value_or(MlpConfig());
        why = absl::StrCat(
            WindowNote(manifest), "mlp.granularity ", MlpGranularityName(config.granularity), ", mlp.hidden H = ",
            config.hidden, ", in = len(sigma) x source.num_kv_heads ",
            manifest.source.num_kv_heads, " x source.head_dim ", manifest.source.head_dim,
            config.granularity == MlpGranularity::kPerHead
                ? absl::StrCat(", leading dim target.num_kv_heads ",
                               manifest.target.num_kv_heads, ", fc3 cols target.head_dim ",
                               manifest.target.head_dim)
                : absl::StrCat(", fc3 cols target.num_kv_heads ", manifest.target.num_kv_heads,
                               " x target.head_dim ", manifest.target.head_dim));
      } else {
        why = RidgeShapeWhy(manifest);
      }
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has shape ",
                                                     FormatShape(t.shape),
                                                     " but the manifest requires ",
                                                     FormatShape(e.shape), " (", why, ")"));
    }
  }
  if (!missing.empty()) {
    std::string message = absl::StrCat("missing tensor ", missing[0]);
    if (missing.size() > 1) absl::StrAppend(&message, " (and ", missing.size() - 1, " more)");
    if (!extra.empty()) {
      absl::StrAppend(&message, "; the file has unexpected tensors ", absl::StrJoin(extra, ", "));
    }
    return absl::InvalidArgumentError(message);
  }
  if (!extra.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "extra tensor ", extra[0], extra.size() > 1 ? absl::StrCat(" (and ", extra.size() - 1, " more)") : "",
        manifest.kind == MapperKind::kMlp
            ? ": an mlp mapper holds only layers.{l}.{k,v}.fc{1,2,3}.{weight,bias} and optional '"
            : ": a ridge mapper holds only layers.{l}.{k,v}.{weight,bias} and optional '",
        kStatsTensorPrefix, "' tensors"));
  }
  return absl::OkStatus();
}

WeightView TensorWeightView(const TensorSpec& spec, const void* data) {
  WeightView view;
  view.data = data;
  view.dtype = spec.dtype;
  view.cols = spec.shape.back();
  view.rows = 1;
  for (size_t d = 0; d + 1 < spec.shape.size(); ++d) view.rows *= spec.shape[d];
  return view;
}

MapperView BuildMapperView(const Manifest& m,
                           const std::function<WeightView(const std::string& name)>& tensor) {
  MapperView view;
  view.kind = m.kind == MapperKind::kMlp ? MapKind::kMlp : MapKind::kRidge;
  view.source = m.source;
  view.target = m.target;
  view.window = m.window;
  view.head_local = m.kind == MapperKind::kRidge &&
                    m.ridge_granularity == RidgeGranularity::kPerHead;
  view.layers.reserve(m.layers.size());
  for (const LayerEntry& entry : m.layers) {
    LayerMapView layer;
    layer.sigma_k = entry.sigma_k;
    layer.sigma_v = entry.sigma_v;
    const int l = entry.target_layer;
    if (m.kind == MapperKind::kMlp) {
      for (const auto& [kv, mlp] :
           {std::pair<char, MlpView*>{'k', &layer.mlp_k}, {'v', &layer.mlp_v}}) {
        mlp->heads =
            m.mlp->granularity == MlpGranularity::kPerHead ? m.target.num_kv_heads : 1;
        mlp->hidden = m.mlp->hidden;
        mlp->a1 = tensor(MlpTensorName(l, kv, 1, false));
        mlp->c1 = tensor(MlpTensorName(l, kv, 1, true));
        mlp->a2 = tensor(MlpTensorName(l, kv, 2, false));
        mlp->c2 = tensor(MlpTensorName(l, kv, 2, true));
        mlp->a3 = tensor(MlpTensorName(l, kv, 3, false));
        mlp->c3 = tensor(MlpTensorName(l, kv, 3, true));
      }
    } else {
      layer.w_k = tensor(MapperTensorName(l, 'k', false));
      layer.b_k = tensor(MapperTensorName(l, 'k', true));
      layer.w_v = tensor(MapperTensorName(l, 'v', false));
      layer.b_v = tensor(MapperTensorName(l, 'v', true));
    }
    view.layers.push_back(std::move(layer));
  }
  return view;
}

absl::StatusOr<std::unique_ptr<LoadedMapper>> LoadMapperDir(const std::string& dir_in,
                                                            const LoadOptions& options) {
  const std::string dir = NormalizeDir(dir_in);
  if (!IsDirectory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a mapper directory (does not exist)"));
  }

  std::map<std::string, std::string> sums;  // file name -> expected hex
  if (options.verify_checksums) {
    absl::StatusOr<std::string> text = ReadFileToString(JoinPath(dir, kChecksumFileName));
    if (!text.ok()) {
      if (absl::IsNotFound(text.status())) {
        return absl::NotFoundError(absl::StrCat(
            dir, ": missing ", kChecksumFileName,
            " (every mapper directory carries one; write mappers with WriteMapperDir / kvt)"));
      }
      return InDir(dir, text.status());
    }
    absl::StatusOr<std::vector<ChecksumEntry>> entries = ParseSha256Sums(*text);
    if (!entries.ok()) return InDir(dir, entries.status());
    for (const ChecksumEntry& entry : *entries) sums[entry.filename] = entry.hex;
  }
  auto expected_sum = [&](const std::string& file) -> absl::StatusOr<std::string> {
    auto it = sums.find(file);
    if (it == sums.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": ", kChecksumFileName, " has no entry for ", file));
    }
    return it->second;
  };

  absl::StatusOr<std::string> manifest_text = ReadFileToString(JoinPath(dir, kManifestFileName));
  if (!manifest_text.ok()) {
    if (absl::IsNotFound(manifest_text.status())) {
      return absl::NotFoundError(absl::StrCat(dir, ": missing ", kManifestFileName));
    }
    return InDir(dir, manifest_text.status());
  }
  if (options.verify_checksums) {
    absl::StatusOr<std::string> expected = expected_sum(kManifestFileName);
    if (!expected.ok()) return expected.status();
    absl::StatusOr<std::string> actual = Sha256Hex(*manifest_text);
    if (!actual.ok()) return InDir(dir, actual.status());
    if (*actual != *expected) {
      return InDir(dir, ChecksumMismatch(kManifestFileName, *expected, *actual));
    }
  }
  absl::StatusOr<Manifest> manifest = ParseManifest(*manifest_text, kManifestFileName);
  if (!manifest.ok()) return InDir(dir, manifest.status());

  const std::string weights_path = JoinPath(dir, manifest->weights_file);
  std::string expected_weights_sum;
  if (options.verify_checksums) {
    absl::StatusOr<std::string> expected = expected_sum(manifest->weights_file);
    if (!expected.ok()) return expected.status();
    expected_weights_sum = *expected;
  }
  SafetensorsReadOptions read_options;
  read_options.allocator = options.allocator;
  read_options.compute_sha256 = options.verify_checksums;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> weights =
      SafetensorsFile::Open(weights_path, read_options);
  if (!weights.ok()) {
    // A damaged file usually fails its checksum too; say so, it is the actionable cause.
    if (options.verify_checksums && PathExists(weights_path)) {
      absl::StatusOr<std::string> actual = Sha256OfFile(weights_path);
      if (actual.ok() && *actual != expected_weights_sum) {
        return absl::DataLossError(absl::StrCat(
            ChecksumMismatch(weights_path, expected_weights_sum, *actual).message(), "; ",
            weights.status().message()));
      }
    }
    return InDir(dir, weights.status());
  }
  if (options.verify_checksums && (*weights)->sha256_hex() != expected_weights_sum) {
    return ChecksumMismatch(weights_path, expected_weights_sum, (*weights)->sha256_hex());
  }
  // sha256sum -c semantics: anything else listed must be intact too.
  for (const auto& [file, hex] : sums) {
    if (file == kManifestFileName || file == manifest->weights_file) continue;
    absl::StatusOr<std::string> actual = Sha256OfFile(JoinPath(dir, file));
    if (!actual.ok()) return InDir(dir, actual.status());
    if (*actual != hex) return InDir(dir, ChecksumMismatch(file, hex, *actual));
  }

  std::vector<TensorSpec> specs;
  for (const TensorInfo& info : (*weights)->tensors()) specs.push_back(info.spec);
  if (absl::Status s = ValidateMapperTensors(*manifest, specs); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(weights_path, ": ", s.message()));
  }

  std::unique_ptr<LoadedMapper> mapper(new LoadedMapper());
  mapper->id_ = Basename(dir);
  mapper->path_ = dir;
  mapper->checksums_verified_ = options.verify_checksums;
  if (options.verify_checksums) mapper->weights_sha256_ = expected_weights_sum;
  mapper->manifest_ = *std::move(manifest);
  mapper->weights_ = *std::move(weights);
  const SafetensorsFile& file = *mapper->weights_;
  mapper->view_ = BuildMapperView(mapper->manifest_, [&file](const std::string& name) {
    const TensorInfo* info = file.Find(name);  // present: validated above
    return TensorWeightView(info->spec, file.data(*info).data());
  });
  return mapper;
}

namespace {

std::string UniqueSuffix() {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(::getpid(), "-", counter++);
}

// A hidden sibling of `dir` on the same file system, so the final rename is atomic and a
// concurrent MapperStore::Scan (which skips dot-directories) never sees a half-written mapper.
std::string TempSibling(const std::string& dir, const std::string& suffix) {
  return JoinPath(Dirname(dir), absl::StrCat(".", Basename(dir), ".tmp-", suffix));
}

// Renames the complete directory `tmp` to `dir`; an existing `dir` is moved aside first and
// removed after (put back when the rename fails). On error `tmp` is left for the caller.
absl::Status MoveIntoPlace(const std::string& tmp, const std::string& dir, bool exists,
                           const std::string& suffix) {
  if (!exists) {
    if (::rename(tmp.c_str(), dir.c_str()) != 0) {
      return ErrnoStatus(errno, "cannot rename into place", dir);
    }
    return absl::OkStatus();
  }
  const std::string old =
      JoinPath(Dirname(dir), absl::StrCat(".", Basename(dir), ".old-", suffix));
  if (::rename(dir.c_str(), old.c_str()) != 0) {
    return ErrnoStatus(errno, "cannot move aside", dir);
  }
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    const absl::Status status = ErrnoStatus(errno, "cannot rename into place", dir);
    ::rename(old.c_str(), dir.c_str());  // put the previous mapper back
    return status;
  }
  RemoveTree(old).IgnoreError();
  return absl::OkStatus();
}

// A fresh temporary sibling of a mapper directory to build its new contents in (TempSibling:
// invisible to MapperStore::Scan), and the suffix MoveIntoPlace names the old one with.
struct Staging {
  std::string tmp;
  std::string suffix;
  // Removes the staged directory and passes `status` on: every failure after MakeStaging.
  absl::Status Discard(absl::Status status) const {
    RemoveTree(tmp).IgnoreError();
    return status;
  }
};

absl::StatusOr<Staging> MakeStaging(const std::string& dir) {
  Staging staging{"", UniqueSuffix()};
  staging.tmp = TempSibling(dir, staging.suffix);
  if (absl::Status s = RemoveTree(staging.tmp); !s.ok()) return s;
  if (absl::Status s = MakeDirs(staging.tmp); !s.ok()) return s;
  return staging;
}

// Makes the staged directory durable and moves it into place as `dir`.
absl::Status Finish(const Staging& staging, const std::string& dir, bool exists) {
  if (absl::Status s = SyncDirectory(staging.tmp); !s.ok()) return s;
  return MoveIntoPlace(staging.tmp, dir, exists, staging.suffix);
}

absl::Status WriteMapperDirImpl(
    const std::string& dir_in, const Manifest& manifest, const std::vector<TensorSpec>& specs,
    const std::function<absl::StatusOr<SafetensorsWriteResult>(const std::string& path)>& write_weights,
    const WriteOptions& options) {
  if (absl::Status s = ValidateManifest(manifest); !s.ok()) return s;
  if (absl::Status s = ValidateMapperTensors(manifest, specs); !s.ok()) return s;
  absl::StatusOr<std::string> manifest_text = EmitManifest(manifest);
  if (!manifest_text.ok()) return manifest_text.status();

  const std::string dir = NormalizeDir(dir_in);
  const std::string parent = Dirname(dir);
  const std::string name = Basename(dir);
  if (name.empty() || name == "." || name == ".." || name == "/") {
    return absl::InvalidArgumentError(absl::StrCat("'", dir_in, "' cannot name a mapper directory"));
  }
  const bool exists = PathExists(dir);
  if (exists && !options.overwrite) {
    return absl::AlreadyExistsError(absl::StrCat(dir, " already exists (overwrite not requested)"));
  }
  if (absl::Status s = MakeDirs(parent); !s.ok()) return s;

  absl::StatusOr<Staging> staging = MakeStaging(dir);
  if (!staging.ok()) return staging.status();
  const std::string& tmp = staging->tmp;
  auto fail = [&staging](absl::Status status) { return staging->Discard(status); };
  if (absl::Status s = WriteStringToFile(JoinPath(tmp, kManifestFileName), *manifest_text); !s.ok()) {
    return fail(s);
  }
  absl::StatusOr<std::string> manifest_sum = Sha256Hex(*manifest_text);
  if (!manifest_sum.ok()) return fail(manifest_sum.status());
  absl::StatusOr<SafetensorsWriteResult> written =
      write_weights(JoinPath(tmp, manifest.weights_file));
  if (!written.ok()) return fail(written.status());
  const std::string sums = FormatSha256Sums(
      {{*manifest_sum, kManifestFileName}, {written->sha256_hex, manifest.weights_file}});
  if (absl::Status s = WriteStringToFile(JoinPath(tmp, kChecksumFileName), sums); !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = Finish(*staging, dir, exists); !s.ok()) return fail(s);
  return SyncDirectory(parent);
}

std::map<std::string, std::string> WeightsMetadata(const Manifest& manifest) {
  return {{"kvt_mapper_format_version", absl::StrCat(manifest.format_version)},
          {"kvt_mapper_kind", MapperKindName(manifest.kind)}};
}

}  // namespace

absl::Status WriteMapperDir(const std::string& dir, const Manifest& manifest,
                            const std::vector<TensorRef>& tensors, const WriteOptions& options) {
  std::vector<TensorSpec> specs;
  for (const TensorRef& t : tensors) specs.push_back(t.spec);
  return WriteMapperDirImpl(
      dir, manifest, specs,
      [&](const std::string& path) {
        return WriteSafetensors(path, tensors, WeightsMetadata(manifest));
      },
      options);
}

absl::Status WriteMapperDir(const std::string& dir, const Manifest& manifest,
                            const std::vector<TensorSpec>& specs, const TensorFiller& fill,
                            const WriteOptions& options) {
  return WriteMapperDirImpl(
      dir, manifest, specs,
      [&](const std::string& path) {
        return WriteSafetensors(path, specs, fill, WeightsMetadata(manifest));
      },
      options);
}

namespace {

// SHA256SUMS of `dir` with the manifest's line given `manifest_hex`; every other line kept.
absl::StatusOr<std::string> SumsWithManifest(const std::string& dir,
                                             const std::string& manifest_hex) {
  absl::StatusOr<std::string> text = ReadFileToString(JoinPath(dir, kChecksumFileName));
  if (!text.ok()) return InDir(dir, text.status());
  absl::StatusOr<std::vector<ChecksumEntry>> entries = ParseSha256Sums(*text);
  if (!entries.ok()) return InDir(dir, entries.status());
  bool listed = false;
  for (ChecksumEntry& entry : *entries) {
    if (entry.filename != kManifestFileName) continue;
    entry.hex = manifest_hex;
    listed = true;
  }
  if (!listed) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": ", kChecksumFileName, " has no entry for ", kManifestFileName));
  }
  return FormatSha256Sums(*entries);
}

// Hard-links every file of `dir` but manifest.yaml and SHA256SUMS into `tmp`: the new directory
// shares the weights' bytes instead of copying them.
absl::Status LinkOtherFiles(const std::string& dir, const std::string& tmp) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return InDir(dir, names.status());
  for (const std::string& name : *names) {
    if (name == kManifestFileName || name == kChecksumFileName) continue;
    const std::string from = JoinPath(dir, name);
    if (IsDirectory(from)) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, ": holds a subdirectory '", name, "' (a mapper directory holds only files)"));
    }
    if (::link(from.c_str(), JoinPath(tmp, name).c_str()) != 0) {
      return ErrnoStatus(errno, "cannot hard-link", from);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RewriteMapperManifest(const LoadedMapper& mapper, const Manifest& manifest) {
  const std::string dir = NormalizeDir(mapper.path());
  if (!mapper.checksums_verified()) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": load the mapper with its checksums verified before rewriting its manifest"));
  }
  if (manifest.weights_file != mapper.manifest().weights_file) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights.file '", manifest.weights_file, "' must stay '",
        mapper.manifest().weights_file, "': a manifest rewrite keeps the weights"));
  }
  if (absl::Status s = ValidateManifest(manifest); !s.ok()) return s;
  std::vector<TensorSpec> specs;
  for (const TensorInfo& info : mapper.weights().tensors()) specs.push_back(info.spec);
  if (absl::Status s = ValidateMapperTensors(manifest, specs); !s.ok()) return s;
  absl::StatusOr<std::string> text = EmitManifest(manifest);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::string> manifest_hex = Sha256Hex(*text);
  if (!manifest_hex.ok()) return manifest_hex.status();
  absl::StatusOr<std::string> sums = SumsWithManifest(dir, *manifest_hex);
  if (!sums.ok()) return sums.status();

  absl::StatusOr<Staging> staging = MakeStaging(dir);
  if (!staging.ok()) return staging.status();
  const std::string& tmp = staging->tmp;
  auto fail = [&staging](absl::Status status) { return staging->Discard(status); };
  if (absl::Status s = WriteStringToFile(JoinPath(tmp, kManifestFileName), *text); !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = WriteStringToFile(JoinPath(tmp, kChecksumFileName), *sums); !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = LinkOtherFiles(dir, tmp); !s.ok()) return fail(s);
  if (absl::Status s = Finish(*staging, dir, /*exists=*/true); !s.ok()) return fail(s);
  return SyncDirectory(Dirname(dir));
}

}  // namespace kvt
