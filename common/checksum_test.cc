#include "common/checksum.h"

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(*Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(*Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, IncrementalEqualsOneShot) {
  Sha256 hasher;
  hasher.Update("a");
  hasher.Update("bc");
  EXPECT_EQ(*hasher.HexDigest(), *Sha256Hex("abc"));
  EXPECT_FALSE(hasher.HexDigest().ok());  // finalised once
}

TEST(Sha256SumsTest, RoundTrip) {
  const std::vector<ChecksumEntry> entries = {
      {std::string(64, 'a'), "manifest.yaml"}, {std::string(64, 'b'), "weights.safetensors"}};
  const std::string text = FormatSha256Sums(entries);
  EXPECT_EQ(text, std::string(64, 'a') + "  manifest.yaml\n" + std::string(64, 'b') +
                      "  weights.safetensors\n");
  absl::StatusOr<std::vector<ChecksumEntry>> parsed = ParseSha256Sums(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_EQ((*parsed)[1].filename, "weights.safetensors");
  EXPECT_EQ((*parsed)[1].hex, std::string(64, 'b'));
}

TEST(Sha256SumsTest, AcceptsBinaryModeUpperCaseAndBlankLines) {
  absl::StatusOr<std::vector<ChecksumEntry>> parsed =
      ParseSha256Sums("\n" + std::string(64, 'A') + " *weights.safetensors\r\n\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 1u);
  EXPECT_EQ((*parsed)[0].hex, std::string(64, 'a'));
}

TEST(Sha256SumsTest, RejectsMalformedLinesByNumber) {
  absl::StatusOr<std::vector<ChecksumEntry>> bad = ParseSha256Sums("xyz  manifest.yaml\n");
  EXPECT_NE(bad.status().message().find("line 1"), absl::string_view::npos) << bad.status();
  bad = ParseSha256Sums(std::string(64, 'a') + "  ok\n" + std::string(63, 'a') + "g  x\n");
  EXPECT_NE(bad.status().message().find("line 2"), absl::string_view::npos) << bad.status();
  bad = ParseSha256Sums(std::string(64, 'a') + "  ../etc/passwd\n");
  EXPECT_NE(bad.status().message().find("plain name"), absl::string_view::npos) << bad.status();
  bad = ParseSha256Sums(std::string(64, 'a') + "  x\n" + std::string(64, 'b') + "  x\n");
  EXPECT_NE(bad.status().message().find("twice"), absl::string_view::npos) << bad.status();
}

}  // namespace
}  // namespace kvt
