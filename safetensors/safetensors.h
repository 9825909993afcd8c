// Reader and writer of the safetensors file format (8-byte little-endian header length, JSON
// header, raw little-endian data) for the BF16 / F16 / F32 tensors of a mapper.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/host_buffer.h"
#include "kernels/types.h"

namespace kvt {

// "BF16" / "F16" / "F32": the safetensors spelling of a dtype.
const char* SafetensorsDTypeName(DType dtype);

// Name, dtype and shape of one tensor, without its bytes.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;

  int64_t num_elements() const;
  uint64_t num_bytes() const { return static_cast<uint64_t>(num_elements()) * DTypeSize(dtype); }
};

// "[128, 64]".
std::string FormatShape(const std::vector<int64_t>& shape);

// One tensor of a file that was read: spec plus where its bytes sit in the data section.
struct TensorInfo {
  TensorSpec spec;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t size = 0;    // bytes
};

// A parsed and validated header: the tensors and metadata, and where the data section lies.
struct SafetensorsHeader {
  uint64_t header_size = 0;  // bytes of JSON after the 8-byte length prefix
  uint64_t data_size = 0;    // bytes after the header: what the tensors fill exactly
  std::vector<TensorInfo> tensors;  // in data-section order
  std::map<std::string, std::string> metadata;  // "__metadata__" (empty if absent)

  uint64_t data_offset() const { return 8 + header_size; }
};

// Reads only the length prefix and header of the file at `path`, with the header checks of
// SafetensorsFile::Open (the tensors' bytes are not read): sizes a load before doing it.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path);

struct SafetensorsReadOptions {
  // Where the data section goes; empty means HostBuffer::Allocate (pageable, 64-byte aligned).
  HostAllocator allocator;
  // Hash the whole file (length prefix, header, data) while reading it, so a SHA256SUMS check
  // costs no second pass over multi-GB weights. The digest is then sha256_hex().
  bool compute_sha256 = false;
};

// A safetensors file read completely into one host buffer. The data section is copied to the
// start of an aligned buffer (the header length is arbitrary, so mmap'ing the file would leave
// tensors misaligned); tensor spans point into it and stay valid as long as this object lives.
//
// Validation (each failure names the tensor and what is wrong):
//   - file shorter than 8 bytes or than its stated header: DATA_LOSS "truncated";
//   - header length above 100 MiB: INVALID_ARGUMENT (not a safetensors file);
//   - header not a JSON object, entries without dtype/shape/data_offsets, bad values:
//     INVALID_ARGUMENT;
//   - dtype other than BF16 / F16 / F32: INVALID_ARGUMENT naming tensor and dtype;
//   - data_offsets reversed, overlapping, leaving a gap, or not matching prod(shape) * dtype size:
//     INVALID_ARGUMENT;
//   - data beyond the end of the file: DATA_LOSS "truncated ... out of range";
//   - bytes after the last tensor: INVALID_ARGUMENT.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path, const SafetensorsReadOptions& options = {});
  // Same checks over an in-memory image of a file (tests, fuzzing, network payloads).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(
      absl::string_view bytes, const SafetensorsReadOptions& options = {});

  // In data-section order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if there is no tensor of that name.
  const TensorInfo* Find(absl::string_view name) const;
  absl::Span<const uint8_t> data(const TensorInfo& tensor) const {
    return absl::Span<const uint8_t>(buffer_.data() + tensor.offset, tensor.size);
  }
  const uint8_t* data_section() const { return buffer_.data(); }
  uint64_t data_size() const { return data_size_; }
  // The "__metadata__" string map (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Lower-case hex SHA-256 of the whole file, if compute_sha256 was set; else empty.
  const std::string& sha256_hex() const { return sha256_hex_; }
  // Where it was read from ("<memory>" for FromBytes).
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }

 private:
  SafetensorsFile() = default;
  void Fill(std::string path, uint64_t file_size, SafetensorsHeader header, HostBuffer buffer);

  std::string path_;
  uint64_t file_size_ = 0;
  uint64_t data_size_ = 0;
  HostBuffer buffer_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
  std::string sha256_hex_;
};

// Fills `dst` (exactly spec.num_bytes() bytes) with the data of tensor `index` of the list being
// written. Lets writers produce multi-GB files one tensor at a time.
using TensorFiller = std::function<absl::Status(size_t index, absl::Span<uint8_t> dst)>;

// A tensor to write whose bytes already sit in memory (not owned).
struct TensorRef {
  TensorSpec spec;
  absl::Span<const uint8_t> bytes;  // must be spec.num_bytes() long
};

struct SafetensorsWriteResult {
  uint64_t file_size = 0;
  std::string sha256_hex;  // of the file as written
};

// Writes tensors in the given order (data offsets ascending, no gaps) after a JSON header padded
// with spaces to a multiple of 8 bytes, as the format allows, so the data section starts
// 8-byte aligned in the file. The file is fsync'ed. Names must be unique and not "__metadata__".
absl::StatusOr<SafetensorsWriteResult> WriteSafetensors(
    const std::string& path, const std::vector<TensorSpec>& specs, const TensorFiller& fill,
    const std::map<std::string, std::string>& metadata = {});
absl::StatusOr<SafetensorsWriteResult> WriteSafetensors(
    const std::string& path, const std::vector<TensorRef>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// The exact bytes WriteSafetensors would write (tests and small payloads).
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata = {});

}  // namespace kvt
