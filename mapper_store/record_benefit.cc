#include "mapper_store/record_benefit.h"

#include <algorithm>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/strict_reader.h"
#include "mapper_store/mapper.h"

namespace kvt {
namespace {

using strict::JsonReader;

absl::StatusOr<BenefitRecord> ParseEntry(const JsonReader& reader, const nlohmann::json& entry,
                                         const std::string& path) {
  if (absl::Status s = reader.CheckObject(entry, path,
                                          {"text", "windows", "context_tokens",
                                           "continuation_tokens", "recovered", "lower95",
                                           "upper95", "kl"});
      !s.ok()) {
    return s;
  }
  BenefitRecord record;
  absl::StatusOr<std::string> text = reader.String(entry, path, "text");
  if (!text.ok()) return text.status();
  record.text = *std::move(text);
  for (const auto& [key, out, min] :
       {std::tuple<const char*, int64_t*, int64_t>{"windows", &record.windows, 2},
        {"context_tokens", &record.context_tokens, 1},
        {"continuation_tokens", &record.continuation_tokens, 1}}) {
    absl::StatusOr<int> value = reader.Int(entry, path, key, min);
    if (!value.ok()) return value.status();
    *out = *value;
  }
  for (const auto& [key, out] : {std::pair<const char*, double*>{"recovered", &record.recovered},
                                 {"lower95", &record.lower95},
                                 {"upper95", &record.upper95},
                                 {"kl", &record.kl}}) {
    absl::StatusOr<double> value = reader.Number(entry, path, key);
    if (!value.ok()) return value.status();
    *out = *value;
  }
  if (absl::Status s = ValidateBenefitRecord(record, path); !s.ok()) {
    return reader.Error(s.message());
  }
  return record;
}

}  // namespace

absl::StatusOr<std::vector<BenefitRecord>> ParseBenefitJson(absl::string_view text,
                                                            absl::string_view label) {
  const JsonReader reader(label);
  absl::StatusOr<nlohmann::json> root = reader.Parse(text);
  if (!root.ok()) return root.status();
  if (absl::Status s = reader.CheckObject(*root, "", {"benefit"}); !s.ok()) return s;
  absl::StatusOr<const nlohmann::json*> list = reader.Required(*root, "", "benefit");
  if (!list.ok()) return list.status();
  if (!(*list)->is_array() || (*list)->empty()) {
    return reader.WrongType(**list, "benefit", "a non-empty list of entries");
  }
  std::vector<BenefitRecord> records;
  for (size_t i = 0; i < (*list)->size(); ++i) {
    const std::string path = absl::StrCat("benefit[", i, "]");
    absl::StatusOr<BenefitRecord> record = ParseEntry(reader, (**list)[i], path);
    if (!record.ok()) return record.status();
    for (size_t j = 0; j < records.size(); ++j) {
      if (records[j].text == record->text) {
        return reader.Error(absl::StrCat(path, ".text '", record->text, "' is already benefit[",
                                         j, "] (one entry per text)"));
      }
    }
    records.push_back(*std::move(record));
  }
  return records;
}

std::vector<BenefitRecord> MergeBenefit(std::vector<BenefitRecord> existing,
                                        const std::vector<BenefitRecord>& incoming) {
  for (const BenefitRecord& record : incoming) {
    auto same = std::find_if(existing.begin(), existing.end(),
                             [&](const BenefitRecord& old) { return old.text == record.text; });
    if (same != existing.end()) {
      *same = record;  // a new measurement of the same text replaces the old one in place
    } else {
      existing.push_back(record);
    }
  }
  return existing;
}

absl::StatusOr<std::vector<BenefitRecord>> RecordBenefit(const std::string& dir,
                                                         const std::string& benefit_path) {
  // The file first: a bad file is reported without hashing a multi-GB mapper.
  absl::StatusOr<std::string> text = ReadFileToString(benefit_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::vector<BenefitRecord>> incoming = ParseBenefitJson(*text, benefit_path);
  if (!incoming.ok()) return incoming.status();
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir);
  if (!mapper.ok()) return mapper.status();
  Manifest manifest = (*mapper)->manifest();
  manifest.quality.benefit = MergeBenefit(manifest.quality.benefit, *incoming);
  if (absl::Status s = RewriteMapperManifest(**mapper, manifest); !s.ok()) return s;
  return manifest.quality.benefit;
}

}  // namespace kvt
