#include "safetensors/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace {

using json = nlohmann::json;

// The Rust reference implementation refuses headers above 100 MB; a mapper header is a few KB
// (four entries per target layer), so anything near this is a corrupt or foreign file.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// Read granularity: big enough to stream at disk speed, small enough to interleave hashing.
constexpr size_t kReadChunk = size_t{64} << 20;

uint64_t DecodeLE64(const unsigned char* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

void EncodeLE64(uint64_t value, char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

absl::StatusOr<DType> ParseTensorDType(const std::string& tensor, const std::string& name) {
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kFP16;
  if (name == "F32") return DType::kFP32;
  static const std::set<std::string>* const kKnownOther = new std::set<std::string>{
      "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "I8", "I16",
      "I32", "I64", "U8", "U16", "U32", "U64", "BOOL", "C64"};
  if (kKnownOther->count(name) > 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' has dtype ", name,
                                                   ", which a mapper cannot hold (supported: "
                                                   "BF16, F16, F32)"));
  }
  return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' has unknown dtype '", name,
                                                 "' (supported: BF16, F16, F32)"));
}

// A non-negative JSON integer, or an error naming the tensor and field.
absl::StatusOr<uint64_t> JsonUnsigned(const json& value, const std::string& tensor,
                                      const char* field) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': ", field,
                                                 " must hold non-negative integers, got ",
                                                 value.dump()));
}

// One tensor's entry of the header: dtype, shape and data_offsets, checked against each other.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& name, const json& entry) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': entry must be a JSON object, got ", entry.dump()));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': missing '", field, "'"));
    }
  }
  TensorInfo info;
  info.spec.name = name;
  if (!entry["dtype"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': dtype must be a string, got ", entry["dtype"].dump()));
  }
  absl::StatusOr<DType> dtype = ParseTensorDType(name, entry["dtype"].get<std::string>());
  if (!dtype.ok()) return dtype.status();
  info.spec.dtype = *dtype;

  const json& shape = entry["shape"];
  if (!shape.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': shape must be an array, got ", shape.dump()));
  }
  // Overflow guard: element counts above 2^62 cannot be real and would wrap the byte count.
  unsigned __int128 elements = 1;
  for (const json& dim : shape) {
    absl::StatusOr<uint64_t> d = JsonUnsigned(dim, name, "shape");
    if (!d.ok()) return d.status();
    elements *= *d;
    if (elements > (static_cast<unsigned __int128>(1) << 62)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shape ", shape.dump(), " is absurdly large"));
    }
    info.spec.shape.push_back(static_cast<int64_t>(*d));
  }

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': data_offsets must be [begin, end], got ", offsets.dump()));
  }
  absl::StatusOr<uint64_t> begin = JsonUnsigned(offsets[0], name, "data_offsets");
  if (!begin.ok()) return begin.status();
  absl::StatusOr<uint64_t> end = JsonUnsigned(offsets[1], name, "data_offsets");
  if (!end.ok()) return end.status();
  if (*end < *begin) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': data_offsets [", *begin,
                                                   ", ", *end, ") are reversed"));
  }
  info.offset = *begin;
  info.size = *end - *begin;
  const uint64_t expected = info.spec.num_bytes();
  if (info.size != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': data_offsets [", *begin, ", ", *end, ") span ", info.size,
        " bytes but shape ", FormatShape(info.spec.shape), " of ",
        SafetensorsDTypeName(info.spec.dtype), " needs ", expected, " bytes"));
  }
  return info;
}

absl::StatusOr<SafetensorsHeader> ParseHeader(absl::string_view text, uint64_t data_size) {
  json header;
  try {
    header = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number too large for any JSON number type.
    return absl::InvalidArgumentError(absl::StrCat("invalid JSON in safetensors header: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header must be a JSON object, got ", header.type_name()));
  }
  SafetensorsHeader parsed;
  parsed.data_size = data_size;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError("__metadata__ must be a JSON object of strings");
      }
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(absl::StrCat("__metadata__ value of '", m.key(),
                                                         "' must be a string, got ",
                                                         m.value().dump()));
        }
        parsed.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(name, entry);
    if (!info.ok()) return info.status();
    parsed.tensors.push_back(*std::move(info));
  }

  std::stable_sort(parsed.tensors.begin(), parsed.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.offset != b.offset ? a.offset < b.offset : a.size < b.size;
                   });
  // The format stores one contiguous buffer: each tensor starts where the previous one ends.
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : parsed.tensors) {
    if (info.offset < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", info.spec.name, "': data_offsets [", info.offset, ", ",
          info.offset + info.size, ") overlap tensor '", previous->spec.name, "' [",
          previous->offset, ", ", cursor, ")"));
    }
    if (info.offset > cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", info.spec.name, "': data_offsets start at ", info.offset,
          " leaving a gap after byte ", cursor, " (tensors must be contiguous)"));
    }
    if (info.offset + info.size > data_size) {
      return absl::DataLossError(absl::StrCat(
          "safetensors file truncated: tensor '", info.spec.name, "' needs data bytes [",
          info.offset, ", ", info.offset + info.size, ") but the data section holds only ",
          data_size, " bytes (data_offsets out of range)"));
    }
    cursor = info.offset + info.size;
    previous = &info;
  }
  if (cursor < data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(data_size - cursor, " unused bytes after the last tensor (data section is ",
                     data_size, " bytes, tensors end at ", cursor, ")"));
  }
  return parsed;
}

// Reads up to `size` bytes at the current position; fewer only at end of file.
absl::StatusOr<size_t> ReadFully(int fd, uint8_t* dst, size_t size, const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, dst + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

class Sink {
 public:
  virtual ~Sink() = default;
  virtual absl::Status Append(const void* data, size_t size) = 0;
};

class StringSink : public Sink {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  absl::Status Append(const void* data, size_t size) override {
    out_->append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }

 private:
  std::string* out_;
};

class FileSink : public Sink {
 public:
  FileSink(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  absl::Status Append(const void* data, size_t size) override {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "cannot write", path_);
      }
      p += n;
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  int fd_;
  std::string path_;
};

// Produces the bytes of tensor `index`, either pointing at caller memory or filling `scratch`.
using TensorSource =
    std::function<absl::StatusOr<absl::Span<const uint8_t>>(size_t index, std::vector<uint8_t>* scratch)>;

absl::StatusOr<SafetensorsWriteResult> WriteTo(Sink* sink, const std::vector<TensorSpec>& specs,
                                               const TensorSource& source,
                                               const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const TensorSpec& spec : specs) {
    if (spec.name.empty() || spec.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("invalid tensor name '", spec.name, "'"));
    }
    if (!names.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' written twice"));
    }
    for (int64_t dim : spec.shape) {
      if (dim < 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "': negative shape ",
                                                       FormatShape(spec.shape)));
      }
    }
    const uint64_t bytes = spec.num_bytes();
    header[spec.name] = {{"dtype", SafetensorsDTypeName(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Space padding is explicitly allowed; aligning the data section to 8 lets readers that mmap
  // the file use the tensors in place.
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');

  Sha256 hasher;
  char prefix[8];
  EncodeLE64(text.size(), prefix);
  for (absl::string_view piece : {absl::string_view(prefix, 8), absl::string_view(text)}) {
    hasher.Update(piece);
    absl::Status status = sink->Append(piece.data(), piece.size());
    if (!status.ok()) return status;
  }
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < specs.size(); ++i) {
    absl::StatusOr<absl::Span<const uint8_t>> bytes = source(i, &scratch);
    if (!bytes.ok()) return bytes.status();
    if (bytes->size() != specs[i].num_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", specs[i].name, "': got ",
                                                     bytes->size(), " bytes, shape ",
                                                     FormatShape(specs[i].shape), " of ",
                                                     SafetensorsDTypeName(specs[i].dtype),
                                                     " needs ", specs[i].num_bytes()));
    }
    hasher.Update(bytes->data(), bytes->size());
    absl::Status status = sink->Append(bytes->data(), bytes->size());
    if (!status.ok()) return status;
  }
  SafetensorsWriteResult result;
  result.file_size = 8 + text.size() + offset;
  absl::StatusOr<std::string> digest = hasher.HexDigest();
  if (!digest.ok()) return digest.status();
  result.sha256_hex = *std::move(digest);
  return result;
}

absl::StatusOr<SafetensorsWriteResult> WriteFile(const std::string& path,
                                                 const std::vector<TensorSpec>& specs,
                                                 const TensorSource& source,
                                                 const std::map<std::string, std::string>& metadata) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "cannot create", path);
  FileSink sink(fd, path);
  absl::StatusOr<SafetensorsWriteResult> result = WriteTo(&sink, specs, source, metadata);
  if (result.ok() && ::fsync(fd) != 0) result = ErrnoStatus(errno, "cannot fsync", path);
  if (::close(fd) != 0 && result.ok()) result = ErrnoStatus(errno, "cannot close", path);
  return result;
}

std::vector<TensorSpec> SpecsOf(const std::vector<TensorRef>& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorRef& t : tensors) specs.push_back(t.spec);
  return specs;
}

TensorSource RefSource(const std::vector<TensorRef>& tensors) {
  return [&tensors](size_t index, std::vector<uint8_t>*) -> absl::StatusOr<absl::Span<const uint8_t>> {
    return tensors[index].bytes;
  };
}

absl::Status WithPath(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
}

struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

// The JSON header's length from the 8-byte little-endian prefix at the start of `start`, checked
// against the `total_size` bytes of the whole file.
absl::StatusOr<uint64_t> HeaderLength(absl::string_view start, uint64_t total_size) {
  if (total_size < 8 || start.size() < 8) {
    return absl::DataLossError(absl::StrCat(
        "truncated: file is ", total_size, " bytes, shorter than the 8-byte header length"));
  }
  const uint64_t header_size = DecodeLE64(reinterpret_cast<const unsigned char*>(start.data()));
  if (header_size > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header length ", header_size, " is implausible (limit 100 MiB): not a safetensors file?"));
  }
  if (header_size > total_size - 8) {
    return absl::DataLossError(absl::StrCat("truncated: header length says ", header_size,
                                            " bytes but only ", total_size - 8, " bytes follow"));
  }
  return header_size;
}

// Reads and parses the length prefix and JSON header of the file open as `fd` (positioned at its
// start), feeding both to `hasher` if set. Leaves `fd` at the start of the data section.
absl::StatusOr<SafetensorsHeader> ReadHeader(int fd, const std::string& path, uint64_t file_size,
                                             Sha256* hasher) {
  if (file_size < 8) return WithPath(path, HeaderLength("", file_size).status());
  char prefix[8];
  absl::StatusOr<size_t> got = ReadFully(fd, reinterpret_cast<uint8_t*>(prefix), 8, path);
  if (!got.ok()) return got.status();
  if (*got != 8) {
    return WithPath(path, absl::DataLossError("truncated while reading the header length"));
  }
  absl::StatusOr<uint64_t> header_size = HeaderLength(absl::string_view(prefix, 8), file_size);
  if (!header_size.ok()) return WithPath(path, header_size.status());
  std::string text(*header_size, '\0');
  got = ReadFully(fd, reinterpret_cast<uint8_t*>(&text[0]), *header_size, path);
  if (!got.ok()) return got.status();
  if (*got != *header_size) {
    return WithPath(path, absl::DataLossError("truncated while reading the header"));
  }
  absl::StatusOr<SafetensorsHeader> header = ParseHeader(text, file_size - 8 - *header_size);
  if (!header.ok()) return WithPath(path, header.status());
  header->header_size = *header_size;
  if (hasher != nullptr) {
    hasher->Update(absl::string_view(prefix, 8));
    hasher->Update(text);
  }
  return header;
}

}  // namespace

const char* SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kFP16:
      return "F16";
    case DType::kFP32:
      return "F32";
  }
  return "?";
}

int64_t TensorSpec::num_elements() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

std::string FormatShape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  return ReadHeader(fd, path, static_cast<uint64_t>(st.st_size), /*hasher=*/nullptr);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path, const SafetensorsReadOptions& options) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  Sha256 hasher;
  absl::StatusOr<SafetensorsHeader> header =
      ReadHeader(fd, path, file_size, options.compute_sha256 ? &hasher : nullptr);
  if (!header.ok()) return header.status();
  const uint64_t data_size = header->data_size;
  absl::StatusOr<HostBuffer> buffer =
      options.allocator ? options.allocator(data_size) : HostBuffer::Allocate(data_size);
  if (!buffer.ok()) return WithPath(path, buffer.status());
  if (buffer->size() < data_size) {
    return WithPath(path, absl::InternalError("allocator returned a buffer smaller than requested"));
  }
  for (uint64_t done = 0; done < data_size;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kReadChunk, data_size - done));
    absl::StatusOr<size_t> got = ReadFully(fd, buffer->data() + done, want, path);
    if (!got.ok()) return got.status();
    if (*got != want) {
      return WithPath(path, absl::DataLossError(absl::StrCat(
                                "truncated while reading: file shrank to ",
                                header->data_offset() + done + *got, " bytes")));
    }
    if (options.compute_sha256) hasher.Update(buffer->data() + done, want);
    done += want;
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  if (options.compute_sha256) {
    absl::StatusOr<std::string> digest = hasher.HexDigest();
    if (!digest.ok()) return digest.status();
    file->sha256_hex_ = *std::move(digest);
  }
  file->Fill(path, file_size, *std::move(header), *std::move(buffer));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    absl::string_view bytes, const SafetensorsReadOptions& options) {
  absl::StatusOr<uint64_t> header_size = HeaderLength(bytes, bytes.size());
  if (!header_size.ok()) return header_size.status();
  const absl::string_view data = bytes.substr(8 + *header_size);
  absl::StatusOr<SafetensorsHeader> header =
      ParseHeader(bytes.substr(8, *header_size), data.size());
  if (!header.ok()) return header.status();
  header->header_size = *header_size;
  absl::StatusOr<HostBuffer> buffer =
      options.allocator ? options.allocator(data.size()) : HostBuffer::Allocate(data.size());
  if (!buffer.ok()) return buffer.status();
  if (!data.empty()) std::memcpy(buffer->data(), data.data(), data.size());

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  if (options.compute_sha256) {
    absl::StatusOr<std::string> digest = Sha256Hex(bytes);
    if (!digest.ok()) return digest.status();
    file->sha256_hex_ = *std::move(digest);
  }
  file->Fill("<memory>", bytes.size(), *std::move(header), *std::move(buffer));
  return file;
}

void SafetensorsFile::Fill(std::string path, uint64_t file_size, SafetensorsHeader header,
                           HostBuffer buffer) {
  path_ = std::move(path);
  file_size_ = file_size;
  data_size_ = header.data_size;
  buffer_ = std::move(buffer);
  tensors_ = std::move(header.tensors);
  metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].spec.name] = i;
}

absl::StatusOr<SafetensorsWriteResult> WriteSafetensors(
    const std::string& path, const std::vector<TensorSpec>& specs, const TensorFiller& fill,
    const std::map<std::string, std::string>& metadata) {
  TensorSource source = [&](size_t index, std::vector<uint8_t>* scratch)
      -> absl::StatusOr<absl::Span<const uint8_t>> {
    scratch->resize(specs[index].num_bytes());
    absl::Status status = fill(index, absl::Span<uint8_t>(scratch->data(), scratch->size()));
    if (!status.ok()) return status;
    return absl::Span<const uint8_t>(scratch->data(), scratch->size());
  };
  return WriteFile(path, specs, source, metadata);
}

absl::StatusOr<SafetensorsWriteResult> WriteSafetensors(
    const std::string& path, const std::vector<TensorRef>& tensors,
    const std::map<std::string, std::string>& metadata) {
  return WriteFile(path, SpecsOf(tensors), RefSource(tensors), metadata);
}

absl::StatusOr<std::string> SerializeSafetensors(const std::vector<TensorRef>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  std::string out;
  StringSink sink(&out);
  absl::StatusOr<SafetensorsWriteResult> result =
      WriteTo(&sink, SpecsOf(tensors), RefSource(tensors), metadata);
  if (!result.ok()) return result.status();
  return out;
}

}  // namespace kvt
