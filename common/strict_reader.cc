#include "common/strict_reader.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_join.h"

namespace kvt {
namespace strict {
namespace {

using nlohmann::json;

// What a YAML value is, for "got ..." in type errors.
std::string Describe(const YAML::Node& node) {
  if (node.IsScalar()) return absl::StrCat("'", node.Scalar(), "'");
  if (node.IsNull()) return "null";
  return node.IsMap() ? "a map" : "a list";
}

}  // namespace

std::string Path(absl::string_view path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

std::string UnknownKeyMessage(absl::string_view path, const std::vector<std::string>& allowed) {
  return absl::StrCat("unknown key '", path, "' (allowed: ", absl::StrJoin(allowed, ", "), ")");
}

std::string DuplicateKeyMessage(absl::string_view path) {
  return absl::StrCat("duplicate key '", path, "'");
}

std::string MissingKeyMessage(absl::string_view path) {
  return absl::StrCat("missing required key '", path, "'");
}

std::string WrongTypeMessage(absl::string_view path, absl::string_view expected,
                             absl::string_view got) {
  return absl::StrCat("key '", path, "' must be ", expected, ", got ", got);
}

absl::Status Errors::operator()(int line, absl::string_view message,
                                absl::StatusCode code) const {
  return absl::Status(code, line > 0 ? absl::StrCat(label_, ":", line, ": ", message)
                                     : absl::StrCat(label_, ": ", message));
}

int LineOf(const YAML::Node& node) {
  if (!node.IsDefined()) return 0;
  const YAML::Mark mark = node.Mark();
  return mark.line >= 0 ? mark.line + 1 : 0;
}

// ---- YAML ----

absl::StatusOr<YAML::Node> YamlReader::Load(absl::string_view text) const {
  try {
    return YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    return errors_(e.mark.line >= 0 ? e.mark.line + 1 : 0, absl::StrCat("invalid YAML: ", e.msg));
  } catch (const YAML::Exception& e) {
    return errors_(0, absl::StrCat("invalid YAML: ", e.what()));
  }
}

absl::Status YamlReader::WrongType(const YAML::Node& node, absl::string_view path,
                                   absl::string_view expected) const {
  return Error(node, WrongTypeMessage(path, expected, Describe(node)));
}

absl::Status YamlReader::CheckKeys(const YAML::Node& map, absl::string_view path,
                                   const std::vector<std::string>* allowed) const {
  if (!map.IsMap()) {
    return path.empty() ? Error(map, absl::StrCat("the document must be a map, got ",
                                                  Describe(map)))
                        : WrongType(map, path, "a map");
  }
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    // By value: yaml-cpp's iterator returns a temporary proxy, a reference would dangle.
    const YAML::Node key = it->first;
    if (!key.IsScalar()) {
      return Error(key, absl::StrCat("keys", path.empty() ? "" : absl::StrCat(" in '", path, "'"),
                                     " must be plain strings, not a map or a list"));
    }
    const std::string full = Path(path, key.Scalar());
    if (allowed != nullptr &&
        std::find(allowed->begin(), allowed->end(), key.Scalar()) == allowed->end()) {
      return Error(key, UnknownKeyMessage(full, *allowed));
    }
    if (!seen.insert(key.Scalar()).second) return Error(key, DuplicateKeyMessage(full));
  }
  return absl::OkStatus();
}

absl::Status YamlReader::CheckMap(const YAML::Node& map, absl::string_view path,
                                  const std::vector<std::string>& allowed) const {
  return CheckKeys(map, path, &allowed);
}

absl::Status YamlReader::CheckFreeMap(const YAML::Node& map, absl::string_view path) const {
  return CheckKeys(map, path, nullptr);
}

absl::StatusOr<YAML::Node> YamlReader::Required(const YAML::Node& map, absl::string_view path,
                                                absl::string_view key) const {
  const YAML::Node value = map[std::string(key)];
  if (!value.IsDefined()) return Error(map, MissingKeyMessage(Path(path, key)));
  return value;
}

// ---- JSON ----

std::string JsonReader::Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::StatusOr<json> JsonReader::Parse(absl::string_view text) const {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Error("not valid JSON");
  if (!root.is_object()) return Error("top level is not a JSON object");
  return root;
}

absl::Status JsonReader::WrongType(const json& value, absl::string_view path,
                                   absl::string_view expected) const {
  return Error(WrongTypeMessage(path, expected, Dump(value)));
}

absl::Status JsonReader::CheckObject(const json& object, absl::string_view path,
                                     const std::vector<std::string>& allowed) const {
  if (!object.is_object()) return WrongType(object, path, "an object");
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
      return Error(UnknownKeyMessage(Path(path, it.key()), allowed));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<const json*> JsonReader::Required(const json& object, absl::string_view path,
                                                 absl::string_view key) const {
  auto it = object.find(std::string(key));
  if (it == object.end()) return Error(MissingKeyMessage(Path(path, key)));
  return &*it;
}

absl::StatusOr<std::string> JsonReader::String(const json& object, absl::string_view path,
                                               absl::string_view key) const {
  absl::StatusOr<const json*> value = Required(object, path, key);
  if (!value.ok()) return value.status();
  if (!(*value)->is_string()) return WrongType(**value, Path(path, key), "a string");
  return (*value)->get<std::string>();
}

absl::StatusOr<int> JsonReader::Int(const json& value, absl::string_view path,
                                    int64_t min) const {
  int64_t parsed = 0;
  bool ok = false;
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(INT32_MAX);
    parsed = static_cast<int64_t>(u);
  } else if (value.is_number_integer()) {
    parsed = value.get<int64_t>();
    ok = parsed <= INT32_MAX;
  }
  if (!ok || parsed < min) {
    return WrongType(value, path, absl::StrCat("an integer >= ", min));
  }
  return static_cast<int>(parsed);
}

absl::StatusOr<int> JsonReader::Int(const json& object, absl::string_view path,
                                    absl::string_view key, int64_t min) const {
  absl::StatusOr<const json*> value = Required(object, path, key);
  if (!value.ok()) return value.status();
  return Int(**value, Path(path, key), min);
}

absl::StatusOr<bool> JsonReader::Bool(const json& object, absl::string_view path,
                                      absl::string_view key) const {
  absl::StatusOr<const json*> value = Required(object, path, key);
  if (!value.ok()) return value.status();
  if (!(*value)->is_boolean()) return WrongType(**value, Path(path, key), "true or false");
  return (*value)->get<bool>();
}

absl::StatusOr<double> JsonReader::Number(const json& object, absl::string_view path,
                                          absl::string_view key) const {
  absl::StatusOr<const json*> value = Required(object, path, key);
  if (!value.ok()) return value.status();
  if (!(*value)->is_number()) return WrongType(**value, Path(path, key), "a number");
  return (*value)->get<double>();
}

}  // namespace strict
}  // namespace kvt
