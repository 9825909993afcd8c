// The one strict reader under kvt's hand-written YAML and JSON parsers (mapper manifests,
// kvtd.yaml, imported semantic-router manifests, Hugging Face config.json): every key known and
// given once, every value of its type, required keys present, integers in range; each error
// names the document, the line (YAML) and the field's full path, in one wording for every
// document. (config.json alone allows unknown keys: Hugging Face writes many kvt does not read.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace strict {

// "<path>.<key>", or `key` alone at the top level (`path` empty).
std::string Path(absl::string_view path, absl::string_view key);

// The messages every reader words alike; `path` is the field's full path.
std::string UnknownKeyMessage(absl::string_view path, const std::vector<std::string>& allowed);
std::string DuplicateKeyMessage(absl::string_view path);
std::string MissingKeyMessage(absl::string_view path);
// "key '<path>' must be <expected>, got <got>".
std::string WrongTypeMessage(absl::string_view path, absl::string_view expected,
                             absl::string_view got);

// Errors "<label>:<line>: <message>", or "<label>: <message>" for line 0 (no position: JSON, or
// a struct built in code and validated like a parsed one).
class Errors {
 public:
  explicit Errors(absl::string_view label) : label_(label) {}

  absl::Status operator()(int line, absl::string_view message,
                          absl::StatusCode code = absl::StatusCode::kInvalidArgument) const;
  const std::string& label() const { return label_; }

 private:
  std::string label_;
};

// 1-based source line of a parsed node; 0 when it has none.
int LineOf(const YAML::Node& node);

class YamlReader {
 public:
  explicit YamlReader(absl::string_view label) : errors_(label) {}

  // The document's root; syntax errors are "invalid YAML: ..." at their line.
  absl::StatusOr<YAML::Node> Load(absl::string_view text) const;

  // `map` (the value at `path`) is a map of plain keys, each in `allowed` and given once.
  absl::Status CheckMap(const YAML::Node& map, absl::string_view path,
                        const std::vector<std::string>& allowed) const;
  // The same for a map whose keys are names chosen by the writer (model names, pairs).
  absl::Status CheckFreeMap(const YAML::Node& map, absl::string_view path) const;

  // map[key], which must be present.
  absl::StatusOr<YAML::Node> Required(const YAML::Node& map, absl::string_view path,
                                      absl::string_view key) const;

  // The scalar `node` (at `path`) as T; `type` says what was expected ("an integer").
  template <typename T>
  absl::StatusOr<T> Scalar(const YAML::Node& node, absl::string_view path,
                           absl::string_view type) const;
  template <typename T>
  absl::Status RequiredScalar(const YAML::Node& map, absl::string_view path,
                              absl::string_view key, absl::string_view type, T* out) const;
  // Leaves *out as it is when the key is absent.
  template <typename T>
  absl::Status OptionalScalar(const YAML::Node& map, absl::string_view path,
                              absl::string_view key, absl::string_view type, T* out) const;

  // A list of scalars; `what` names the list in the type error ("a list of mapper ids").
  template <typename T>
  absl::StatusOr<std::vector<T>> ScalarList(const YAML::Node& node, absl::string_view path,
                                            absl::string_view what, absl::string_view type) const;

  absl::Status Error(const YAML::Node& at, absl::string_view message) const {
    return errors_(LineOf(at), message);
  }
  absl::Status WrongType(const YAML::Node& node, absl::string_view path,
                         absl::string_view expected) const;
  const Errors& errors() const { return errors_; }

 private:
  absl::Status CheckKeys(const YAML::Node& map, absl::string_view path,
                         const std::vector<std::string>* allowed) const;

  Errors errors_;
};

class JsonReader {
 public:
  explicit JsonReader(absl::string_view label) : errors_(label) {}

  // The document, which must be a JSON object.
  absl::StatusOr<nlohmann::json> Parse(absl::string_view text) const;

  // `object` (the value at `path`) is an object whose keys are all in `allowed`.
  absl::Status CheckObject(const nlohmann::json& object, absl::string_view path,
                           const std::vector<std::string>& allowed) const;

  absl::StatusOr<const nlohmann::json*> Required(const nlohmann::json& object,
                                                 absl::string_view path,
                                                 absl::string_view key) const;
  absl::StatusOr<std::string> String(const nlohmann::json& object, absl::string_view path,
                                     absl::string_view key) const;
  // An integer in [min, 2^31); JSON floats, strings and booleans are refused.
  absl::StatusOr<int> Int(const nlohmann::json& value, absl::string_view path, int64_t min) const;
  absl::StatusOr<int> Int(const nlohmann::json& object, absl::string_view path,
                          absl::string_view key, int64_t min) const;
  absl::StatusOr<bool> Bool(const nlohmann::json& object, absl::string_view path,
                            absl::string_view key) const;
  absl::StatusOr<double> Number(const nlohmann::json& object, absl::string_view path,
                                absl::string_view key) const;

  absl::Status Error(absl::string_view message) const { return errors_(0, message); }
  absl::Status WrongType(const nlohmann::json& value, absl::string_view path,
                         absl::string_view expected) const;

  // Any value as compact JSON for messages; invalid UTF-8 is replaced instead of throwing.
  static std::string Dump(const nlohmann::json& value);

 private:
  Errors errors_;
};

// ---- Templates ----

template <typename T>
absl::StatusOr<T> YamlReader::Scalar(const YAML::Node& node, absl::string_view path,
                                     absl::string_view type) const {
  if (node.IsScalar()) {
    try {
      return node.as<T>();
    } catch (const YAML::Exception&) {
      // Falls through to the type error, which quotes the text.
    }
  }
  return WrongType(node, path, type);
}

template <typename T>
absl::Status YamlReader::RequiredScalar(const YAML::Node& map, absl::string_view path,
                                        absl::string_view key, absl::string_view type,
                                        T* out) const {
  absl::StatusOr<YAML::Node> node = Required(map, path, key);
  if (!node.ok()) return node.status();
  absl::StatusOr<T> value = Scalar<T>(*node, Path(path, key), type);
  if (!value.ok()) return value.status();
  *out = *std::move(value);
  return absl::OkStatus();
}

template <typename T>
absl::Status YamlReader::OptionalScalar(const YAML::Node& map, absl::string_view path,
                                        absl::string_view key, absl::string_view type,
                                        T* out) const {
  const YAML::Node node = map[std::string(key)];
  if (!node.IsDefined()) return absl::OkStatus();
  absl::StatusOr<T> value = Scalar<T>(node, Path(path, key), type);
  if (!value.ok()) return value.status();
  *out = *std::move(value);
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<std::vector<T>> YamlReader::ScalarList(const YAML::Node& node,
                                                      absl::string_view path,
                                                      absl::string_view what,
                                                      absl::string_view type) const {
  if (!node.IsSequence()) return WrongType(node, path, what);
  std::vector<T> values;
  for (size_t i = 0; i < node.size(); ++i) {
    absl::StatusOr<T> value = Scalar<T>(node[i], absl::StrCat(path, "[", i, "]"), type);
    if (!value.ok()) return value.status();
    values.push_back(*std::move(value));
  }
  return values;
}

}  // namespace strict
}  // namespace kvt
