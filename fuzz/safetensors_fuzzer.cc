// Fuzz target: SafetensorsFile::FromBytes (mapper weights, KV dump files). Accepted files must be
// self-consistent, and serializing what was read must read back identically.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::unique_ptr<kvt::SafetensorsFile>> file = kvt::SafetensorsFile::FromBytes(bytes);
  if (!file.ok()) {
    FUZZ_CHECK(!file.status().message().empty());
    return 0;
  }
  const kvt::SafetensorsFile& f = **file;
  FUZZ_CHECK(f.data_size() <= size);
  std::vector<kvt::TensorRef> refs;
  uint64_t expected_offset = 0;
  for (const kvt::TensorInfo& tensor : f.tensors()) {
    FUZZ_CHECK(tensor.offset == expected_offset);  // ascending, no gaps
    FUZZ_CHECK(tensor.size == tensor.spec.num_bytes());
    FUZZ_CHECK(tensor.offset <= f.data_size() && tensor.size <= f.data_size() - tensor.offset);
    FUZZ_CHECK(f.Find(tensor.spec.name) == &tensor);
    absl::Span<const uint8_t> span = f.data(tensor);
    if (!span.empty()) {
      volatile uint8_t sink = span.front() ^ span.back();  // inside the buffer (ASan checks)
      (void)sink;
    }
    refs.push_back({tensor.spec, span});
    expected_offset += tensor.size;
  }
  FUZZ_CHECK(expected_offset == f.data_size());

  // Round trip: what was read, written again, reads back as the same tensors and metadata.
  absl::StatusOr<std::string> again = kvt::SerializeSafetensors(refs, f.metadata());
  if (!again.ok()) return 0;  // e.g. a name the writer refuses; the reader may be more lenient
  absl::StatusOr<std::unique_ptr<kvt::SafetensorsFile>> reread = kvt::SafetensorsFile::FromBytes(*again);
  FUZZ_CHECK(reread.ok());
  FUZZ_CHECK((*reread)->tensors().size() == f.tensors().size());
  FUZZ_CHECK((*reread)->metadata() == f.metadata());
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const kvt::TensorInfo& a = f.tensors()[i];
    const kvt::TensorInfo& b = (*reread)->tensors()[i];
    FUZZ_CHECK(a.spec.name == b.spec.name && a.spec.dtype == b.spec.dtype &&
               a.spec.shape == b.spec.shape && a.size == b.size);
    FUZZ_CHECK(std::equal(f.data(a).begin(), f.data(a).end(), (*reread)->data(b).begin()));
  }
  return 0;
}
