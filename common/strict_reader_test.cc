#include "common/strict_reader.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace strict {
namespace {

using ::testing::HasSubstr;
using nlohmann::json;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(StrictReaderTest, ErrorsNameTheDocumentAndLine) {
  const Errors errors("a.yaml");
  EXPECT_EQ(Message(errors(3, "boom")), "a.yaml:3: boom");
  EXPECT_EQ(Message(errors(0, "boom")), "a.yaml: boom");
  EXPECT_EQ(errors(1, "x", absl::StatusCode::kFailedPrecondition).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Path("", "k"), "k");
  EXPECT_EQ(Path("a.b", "k"), "a.b.k");
}

TEST(StrictReaderTest, YamlSyntaxErrorNamesTheLine) {
  const YamlReader reader("s.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("a: 1\nb: [1, 2\n");
  ASSERT_FALSE(root.ok());
  EXPECT_THAT(Message(root.status()), HasSubstr("s.yaml:"));
  EXPECT_THAT(Message(root.status()), HasSubstr("invalid YAML"));
}

TEST(StrictReaderTest, YamlUnknownKeyIsNamedWithItsPathLineAndTheAllowedKeys) {
  const YamlReader reader("m.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("outer:\n  good: 1\n  bda: 2\n");
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_TRUE(reader.CheckMap(*root, "", {"outer"}).ok());
  absl::Status status = reader.CheckMap((*root)["outer"], "outer", {"good", "bad"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "m.yaml:3: unknown key 'outer.bda' (allowed: good, bad)");
}

TEST(StrictReaderTest, YamlDuplicateAndNonScalarKeysAreRefused) {
  const YamlReader reader("d.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("s:\n  a: 1\n  a: 2\n");
  ASSERT_TRUE(root.ok());
  EXPECT_EQ(Message(reader.CheckMap((*root)["s"], "s", {"a"})), "d.yaml:3: duplicate key 's.a'");
  EXPECT_EQ(Message(reader.CheckFreeMap((*root)["s"], "s")), "d.yaml:3: duplicate key 's.a'");
  root = reader.Load("{{}: 1}\n");
  ASSERT_TRUE(root.ok());
  EXPECT_THAT(Message(reader.CheckFreeMap(*root, "")),
              HasSubstr("keys must be plain strings, not a map or a list"));
}

TEST(StrictReaderTest, YamlNonMapIsATypeError) {
  const YamlReader reader("t.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("s: [1, 2]\n");
  ASSERT_TRUE(root.ok());
  EXPECT_EQ(Message(reader.CheckMap((*root)["s"], "s", {"a"})),
            "t.yaml:1: key 's' must be a map, got a list");
  EXPECT_THAT(Message(reader.CheckMap((*root)["s"], "", {"a"})),
              HasSubstr("the document must be a map"));
}

TEST(StrictReaderTest, YamlScalarsAreTypeChecked) {
  const YamlReader reader("v.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("s:\n  n: 7\n  x: lots\n  m: {a: 1}\n  z: ~\n");
  ASSERT_TRUE(root.ok());
  const YAML::Node s = (*root)["s"];
  int64_t n = 0;
  EXPECT_TRUE(reader.RequiredScalar(s, "s", "n", "an integer", &n).ok());
  EXPECT_EQ(n, 7);
  EXPECT_EQ(Message(reader.RequiredScalar(s, "s", "x", "an integer", &n)),
            "v.yaml:3: key 's.x' must be an integer, got 'lots'");
  EXPECT_EQ(Message(reader.RequiredScalar(s, "s", "m", "a number", &n)),
            "v.yaml:4: key 's.m' must be a number, got a map");
  EXPECT_EQ(Message(reader.RequiredScalar(s, "s", "z", "a string", &n)),
            "v.yaml:5: key 's.z' must be a string, got null");
  EXPECT_EQ(Message(reader.RequiredScalar(s, "s", "gone", "an integer", &n)),
            "v.yaml:2: missing required key 's.gone'");
  n = 5;
  EXPECT_TRUE(reader.OptionalScalar(s, "s", "gone", "an integer", &n).ok());
  EXPECT_EQ(n, 5);
  bool flag = false;
  EXPECT_EQ(Message(reader.OptionalScalar(s, "s", "x", "true or false", &flag)),
            "v.yaml:3: key 's.x' must be true or false, got 'lots'");
}

TEST(StrictReaderTest, YamlListsCheckEveryElement) {
  const YamlReader reader("l.yaml");
  absl::StatusOr<YAML::Node> root = reader.Load("ok: [1, 2]\nbad: [1, b]\nnot: 3\n");
  ASSERT_TRUE(root.ok());
  absl::StatusOr<std::vector<int>> ok = reader.ScalarList<int>((*root)["ok"], "ok", "a list",
                                                               "an integer");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (std::vector<int>{1, 2}));
  EXPECT_EQ(Message(reader.ScalarList<int>((*root)["bad"], "bad", "a list", "an integer")
                        .status()),
            "l.yaml:2: key 'bad[1]' must be an integer, got 'b'");
  EXPECT_EQ(Message(reader.ScalarList<int>((*root)["not"], "not", "a list of ids", "a string")
                        .status()),
            "l.yaml:3: key 'not' must be a list of ids, got '3'");
}

TEST(StrictReaderTest, JsonDocumentMustBeAnObject) {
  const JsonReader reader("m.json");
  EXPECT_EQ(Message(reader.Parse("{").status()), "m.json: not valid JSON");
  EXPECT_EQ(Message(reader.Parse("[1]").status()), "m.json: top level is not a JSON object");
  EXPECT_TRUE(reader.Parse("{\"a\": 1}").ok());
}

TEST(StrictReaderTest, JsonFieldsAreRequiredTypedAndInRange) {
  const JsonReader reader("m.json");
  const json root = json::parse(
      R"({"c": {"s": "x", "n": 3, "neg": -2, "f": 1.5, "b": true, "big": 4294967296}})");
  const json& c = root["c"];
  EXPECT_EQ(*reader.String(c, "c", "s"), "x");
  EXPECT_EQ(*reader.Int(c, "c", "n", 1), 3);
  EXPECT_EQ(*reader.Bool(c, "c", "b"), true);
  EXPECT_EQ(*reader.Number(c, "c", "f"), 1.5);
  EXPECT_EQ(Message(reader.String(c, "c", "n").status()),
            "m.json: key 'c.n' must be a string, got 3");
  EXPECT_EQ(Message(reader.Int(c, "c", "neg", 0).status()),
            "m.json: key 'c.neg' must be an integer >= 0, got -2");
  EXPECT_EQ(Message(reader.Int(c, "c", "f", 0).status()),
            "m.json: key 'c.f' must be an integer >= 0, got 1.5");
  EXPECT_EQ(Message(reader.Int(c, "c", "s", 0).status()),
            "m.json: key 'c.s' must be an integer >= 0, got \"x\"");
  EXPECT_FALSE(reader.Int(c, "c", "big", 0).ok());
  EXPECT_EQ(Message(reader.Bool(c, "c", "n").status()),
            "m.json: key 'c.n' must be true or false, got 3");
  EXPECT_EQ(Message(reader.Number(c, "c", "s").status()),
            "m.json: key 'c.s' must be a number, got \"x\"");
  EXPECT_EQ(Message(reader.Int(c, "c", "gone", 0).status()),
            "m.json: missing required key 'c.gone'");
}

TEST(StrictReaderTest, JsonUnknownKeysAreNamed) {
  const JsonReader reader("m.json");
  const json root = json::parse(R"({"c": {"a": 1, "colour": 2}, "l": [1]})");
  EXPECT_TRUE(reader.CheckObject(root, "", {"c", "l"}).ok());
  EXPECT_EQ(Message(reader.CheckObject(root["c"], "c", {"a", "b"})),
            "m.json: unknown key 'c.colour' (allowed: a, b)");
  EXPECT_EQ(Message(reader.CheckObject(root["l"], "l", {"a"})),
            "m.json: key 'l' must be an object, got [1]");
}

}  // namespace
}  // namespace strict
}  // namespace kvt
