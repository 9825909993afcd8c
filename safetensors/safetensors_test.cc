#include "safetensors/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "mapper_store/format/test_util.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

// A file image from a raw header string and data bytes, as a foreign writer might produce.
std::string Raw(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  FromFloat(dtype, values.data(), bytes.data(), static_cast<int64_t>(values.size()));
  return bytes;
}

absl::Span<const uint8_t> SpanOf(const std::vector<uint8_t>& v) { return {v.data(), v.size()}; }

TEST(SafetensorsTest, RoundTripAllDTypesThroughAFile) {
  const std::string dir = testing::MakeTempDir("st_roundtrip");
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f, -0.0f, 1024.0f};
  const std::vector<uint8_t> bf16 = Encode(DType::kBF16, values);
  const std::vector<uint8_t> f16 = Encode(DType::kFP16, values);
  const std::vector<uint8_t> f32 = Encode(DType::kFP32, values);
  std::vector<TensorRef> tensors = {
      {{"a.bf16", DType::kBF16, {2, 3}}, SpanOf(bf16)},
      {{"b.f16", DType::kFP16, {6}}, SpanOf(f16)},
      {{"c.f32", DType::kFP32, {3, 2}}, SpanOf(f32)},
      {{"d.empty", DType::kFP32, {0, 4}}, {}},
  };
  const std::string path = JoinPath(dir, "t.safetensors");
  absl::StatusOr<SafetensorsWriteResult> written =
      WriteSafetensors(path, tensors, {{"format", "kvt-test"}});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->file_size, *FileSize(path));
  EXPECT_EQ(written->sha256_hex, *Sha256OfFile(path));

  SafetensorsReadOptions options;
  options.compute_sha256 = true;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path, options);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->sha256_hex(), written->sha256_hex);
  EXPECT_EQ((*file)->metadata().at("format"), "kvt-test");
  EXPECT_EQ((*file)->data_size(), bf16.size() + f16.size() + f32.size());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*file)->data_section()) % 64, 0u);
  // Header padded so the data section starts 8-byte aligned in the file.
  EXPECT_EQ(((*file)->file_size() - (*file)->data_size()) % 8, 0u);
  ASSERT_EQ((*file)->tensors().size(), 4u);
  EXPECT_EQ((*file)->tensors()[0].spec.name, "a.bf16");  // data order kept

  for (const TensorRef& ref : tensors) {
    const TensorInfo* info = (*file)->Find(ref.spec.name);
    ASSERT_NE(info, nullptr) << ref.spec.name;
    EXPECT_EQ(info->spec.dtype, ref.spec.dtype);
    EXPECT_EQ(info->spec.shape, ref.spec.shape);
    absl::Span<const uint8_t> data = (*file)->data(*info);
    ASSERT_EQ(data.size(), ref.bytes.size());
    if (!data.empty()) {
      EXPECT_EQ(0, std::memcmp(data.data(), ref.bytes.data(), data.size()));
    }
  }
  std::vector<float> back(values.size());
  ToFloat(DType::kBF16, (*file)->data(*(*file)->Find("a.bf16")).data(), back.data(), 6);
  EXPECT_EQ(back, values);
  EXPECT_EQ((*file)->Find("nope"), nullptr);
}

TEST(SafetensorsTest, SerializeMatchesFileAndParsesFromBytes) {
  const std::vector<uint8_t> f32 = Encode(DType::kFP32, {1, 2, 3, 4});
  std::vector<TensorRef> tensors = {{{"x", DType::kFP32, {4}}, SpanOf(f32)}};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors);
  ASSERT_TRUE(bytes.ok());
  const std::string path = JoinPath(testing::MakeTempDir("st_serialize"), "x.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  EXPECT_EQ(*ReadFileToString(path), *bytes);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->Find("x")->size, 16u);
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsTest, HeaderAloneMatchesTheFullRead) {
  const std::vector<uint8_t> bf16 = Encode(DType::kBF16, {1, 2, 3, 4, 5, 6});
  const std::vector<uint8_t> f32 = Encode(DType::kFP32, {1, 2});
  const std::string path = JoinPath(testing::MakeTempDir("st_header"), "h.safetensors");
  ASSERT_TRUE(WriteSafetensors(path,
                               {{{"w", DType::kBF16, {2, 3}}, SpanOf(bf16)},
                                {{"b", DType::kFP32, {2}}, SpanOf(f32)}},
                               {{"rope", "post"}})
                  .ok());
  absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(path);
  ASSERT_TRUE(header.ok()) << header.status();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(header->data_size, (*file)->data_size());
  EXPECT_EQ(header->data_size, bf16.size() + f32.size());
  EXPECT_EQ(header->data_offset() + header->data_size, *FileSize(path));
  EXPECT_EQ(header->metadata, (*file)->metadata());
  ASSERT_EQ(header->tensors.size(), 2u);
  EXPECT_EQ(header->tensors[1].spec.name, "b");
  EXPECT_EQ(header->tensors[1].offset, bf16.size());
  EXPECT_EQ(ReadSafetensorsHeader(JoinPath(path, "missing")).status().code(),
            StatusCode::kNotFound);
}

TEST(SafetensorsTest, ReadsAForeignFileWithUnpaddedHeader) {
  // Written by hand the way other writers may do it: no padding, tensors listed out of order.
  float data[3] = {1.5f, 2.5f, -1.0f};
  std::string raw_data(reinterpret_cast<const char*>(data), sizeof(data));
  const std::string header =
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}})";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(Raw(header, raw_data));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors()[0].spec.name, "a");
  float b;
  std::memcpy(&b, (*file)->data(*(*file)->Find("b")).data(), 4);
  EXPECT_EQ(b, -1.0f);
}

TEST(SafetensorsTest, StreamingWriterCallsFillerPerTensor) {
  const std::string path = JoinPath(testing::MakeTempDir("st_stream"), "s.safetensors");
  std::vector<TensorSpec> specs = {{"p", DType::kBF16, {3}}, {"q", DType::kFP32, {2}}};
  std::vector<size_t> calls;
  absl::StatusOr<SafetensorsWriteResult> result = WriteSafetensors(
      path, specs, [&](size_t index, absl::Span<uint8_t> dst) {
        calls.push_back(index);
        std::memset(dst.data(), static_cast<int>(index + 1), dst.size());
        return absl::OkStatus();
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(calls, (std::vector<size_t>{0, 1}));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->data(*(*file)->Find("q"))[7], 2);

  // A failing filler aborts the write with its own error.
  absl::StatusOr<SafetensorsWriteResult> failed = WriteSafetensors(
      path, specs, [](size_t, absl::Span<uint8_t>) { return absl::CancelledError("stop"); });
  EXPECT_EQ(failed.status().code(), StatusCode::kCancelled);
}

TEST(SafetensorsTest, CustomAllocatorHoldsTheData) {
  int allocations = 0;
  SafetensorsReadOptions options;
  options.allocator = [&](size_t size) {
    ++allocations;
    return HostBuffer::Allocate(size, 4096);
  };
  const std::vector<uint8_t> f32 = Encode(DType::kFP32, {1, 2});
  absl::StatusOr<std::string> bytes = SerializeSafetensors({{{"x", DType::kFP32, {2}}, SpanOf(f32)}});
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(*bytes, options);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(allocations, 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*file)->data_section()) % 4096, 0u);
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  const std::vector<uint8_t> f32 = Encode(DType::kFP32, {1, 2});
  KVT_EXPECT_ERROR(SerializeSafetensors({{{"x", DType::kFP32, {3}}, SpanOf(f32)}}),
                   StatusCode::kInvalidArgument, "needs 12");
  KVT_EXPECT_ERROR(SerializeSafetensors({{{"x", DType::kFP32, {2}}, SpanOf(f32)},
                                         {{"x", DType::kFP32, {2}}, SpanOf(f32)}}),
                   StatusCode::kInvalidArgument, "written twice");
  KVT_EXPECT_ERROR(SerializeSafetensors({{{"__metadata__", DType::kFP32, {2}}, SpanOf(f32)}}),
                   StatusCode::kInvalidArgument, "invalid tensor name");
}

// --- Corrupt inputs: each gives its own, specific error. ---

class CorruptSafetensorsTest : public ::testing::Test {
 protected:
  // Reads through a real file so the Open path (not only FromBytes) is exercised.
  absl::Status OpenRaw(const std::string& bytes) {
    const std::string path = JoinPath(dir_, "bad.safetensors");
    EXPECT_TRUE(WriteStringToFile(path, bytes).ok());
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> from_file = SafetensorsFile::Open(path);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> from_bytes = SafetensorsFile::FromBytes(bytes);
    absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(path);
    // Every reader agrees on the verdict: the header alone shows each corruption.
    EXPECT_EQ(from_file.status().code(), from_bytes.status().code()) << from_file.status();
    EXPECT_EQ(from_file.status().code(), header.status().code()) << header.status();
    if (!from_file.ok()) {
      EXPECT_NE(from_file.status().message().find(path), absl::string_view::npos)
          << "error should name the file: " << from_file.status();
    }
    return from_file.status();
  }

  std::string Good() {
    static const std::vector<uint8_t> a = Encode(DType::kBF16, {1, 2, 3, 4});
    static const std::vector<uint8_t> b = Encode(DType::kFP32, {5, 6});
    return *SerializeSafetensors({{{"a", DType::kBF16, {2, 2}}, SpanOf(a)},
                                  {{"b", DType::kFP32, {2}}, SpanOf(b)}});
  }

  std::string dir_ = testing::MakeTempDir("st_corrupt");
};

TEST_F(CorruptSafetensorsTest, GoodFileIsAccepted) { KVT_EXPECT_OK(OpenRaw(Good())); }

TEST_F(CorruptSafetensorsTest, TruncatedData) {
  const std::string good = Good();
  KVT_EXPECT_ERROR(OpenRaw(good.substr(0, good.size() - 3)), StatusCode::kDataLoss, "truncated");
}

TEST_F(CorruptSafetensorsTest, TruncatedHeader) {
  KVT_EXPECT_ERROR(OpenRaw(Good().substr(0, 20)), StatusCode::kDataLoss,
                   "truncated: header length says");
}

TEST_F(CorruptSafetensorsTest, TruncatedLengthPrefix) {
  KVT_EXPECT_ERROR(OpenRaw("abc"), StatusCode::kDataLoss, "shorter than the 8-byte header length");
}

TEST_F(CorruptSafetensorsTest, ImplausibleHeaderLength) {
  std::string bytes(16, '\xff');
  KVT_EXPECT_ERROR(OpenRaw(bytes), StatusCode::kInvalidArgument, "implausible");
}

TEST_F(CorruptSafetensorsTest, BadJson) {
  KVT_EXPECT_ERROR(OpenRaw(Raw("{\"a\": {", "")), StatusCode::kInvalidArgument, "invalid JSON");
  KVT_EXPECT_ERROR(OpenRaw(Raw("[1, 2]", "")), StatusCode::kInvalidArgument,
                   "must be a JSON object");
}

TEST_F(CorruptSafetensorsTest, OffsetsOutOfRange) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, 'x'))),
      StatusCode::kDataLoss, "out of range");
}

TEST_F(CorruptSafetensorsTest, ReversedOffsets) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", std::string(8, 'x'))),
      StatusCode::kInvalidArgument, "reversed");
}

TEST_F(CorruptSafetensorsTest, OverlappingTensors) {
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                               std::string(12, 'x'))),
                   StatusCode::kInvalidArgument, "overlap tensor 'a'");
}

TEST_F(CorruptSafetensorsTest, GapBetweenTensors) {
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                               std::string(12, 'x'))),
                   StatusCode::kInvalidArgument, "gap");
}

TEST_F(CorruptSafetensorsTest, TrailingBytes) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(6, 'x'))),
      StatusCode::kInvalidArgument, "2 unused bytes");
}

TEST_F(CorruptSafetensorsTest, WrongByteCount) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x'))),
      StatusCode::kInvalidArgument, "tensor 'w': data_offsets [0, 8) span 8 bytes but shape [3] of BF16 needs 6");
}

TEST_F(CorruptSafetensorsTest, UnsupportedDType) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", std::string(8, 'x'))),
      StatusCode::kInvalidArgument, "tensor 'w' has dtype F64");
}

TEST_F(CorruptSafetensorsTest, UnknownDType) {
  KVT_EXPECT_ERROR(
      OpenRaw(Raw(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", std::string(1, 'x'))),
      StatusCode::kInvalidArgument, "unknown dtype 'Q4'");
}

TEST_F(CorruptSafetensorsTest, MissingOrMistypedFields) {
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"w":{"dtype":"F32","shape":[1]}})", "")),
                   StatusCode::kInvalidArgument, "tensor 'w': missing 'data_offsets'");
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", "")),
                   StatusCode::kInvalidArgument, "non-negative");
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "")),
                   StatusCode::kInvalidArgument, "[begin, end]");
  KVT_EXPECT_ERROR(OpenRaw(Raw(R"({"__metadata__":{"n":1}})", "")), StatusCode::kInvalidArgument,
                   "must be a string");
}

}  // namespace
}  // namespace kvt
