#include "tests/translation_case.h"

#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/dtype.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace testing {

std::string Describe(const TranslationCase& c) {
  return absl::StrCat(c.mapper, " ", DTypeName(c.dtype), " ", LayoutName(c.layout), " -> ",
                      DTypeName(c.output_dtype), " ", LayoutName(c.output_layout),
                      " T=", c.tokens, c.explicit_positions ? " explicit positions" : "",
                      " offset=", c.offset);
}

void ExpectTranslationMatchesReference(Client& client, const LoadedMapper& mapper,
                                       const TranslationCase& c, uint64_t seed,
                                       double tolerance) {
  SCOPED_TRACE(Describe(c));
  const HostCache source =
      RandomHostCache(mapper.view().source, c.tokens, c.dtype, c.layout, seed);
  v1::TranslateHeader header;
  header.set_source_model(mapper.view().source.name);  // found by pair, like any mapper
  header.set_target_model(mapper.view().target.name);
  header.set_output_dtype(DTypeToProto(c.output_dtype));
  header.set_output_layout(LayoutToProto(c.output_layout));
  std::vector<uint64_t> explicit_positions;
  Positions positions;
  if (c.explicit_positions) {
    std::mt19937_64 rng(seed);
    for (int64_t i = 0; i < c.tokens; ++i) {
      explicit_positions.push_back(rng() % 100000);
      header.add_positions(explicit_positions.back());
    }
    positions.explicit_positions = explicit_positions.data();
  } else {
    header.set_position_offset(c.offset);
    positions.offset = c.offset;
  }
  absl::StatusOr<TranslateResult> result = client.Translate(header, source);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->header.mapper_id(), c.mapper);
  EXPECT_EQ(result->target.dtype, c.output_dtype);
  EXPECT_EQ(result->target.layout, c.output_layout);
  EXPECT_EQ(result->trailer.num_tokens(), static_cast<uint64_t>(c.tokens));
  EXPECT_GT(result->trailer.timings().total_ms(), 0);
  // The reference reads the same rounded inputs and weights: what remains is the arithmetic
  // and the output's rounding.
  EXPECT_LE(MaxErrorAgainstReference(mapper.view(), source.view(), result->target.view(),
                                     positions),
            tolerance);
}

}  // namespace testing
}  // namespace kvt
