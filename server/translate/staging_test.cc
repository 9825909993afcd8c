// staging: region leases over real POSIX shm objects registered in a real SystemMemoryRegistry,
// the bytes admission accounts, and the source view over inline buffers, a packed region read
// in place and a paged region gathered.
#include "server/translate/staging.h"

#include <cstring>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/translate_testing.h"
#include "tests/shm_object.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

class StagingTest : public ::testing::Test {
 protected:
  void Register(const std::string& name, const test::ShmObject& object) {
    KVT_ASSERT_OK(system_.Register(name, object.key(), 0, object.size()));
  }

  TinyStore tiny_;
  SystemMemoryRegistry system_;
  CudaMemoryRegistry cuda_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(0);
};

TEST_F(StagingTest, InlineSourceGetsLayerBuffers) {
  const v1::TranslateHeader header = TinyHeader(16);
  const TranslatePlan plan = tiny_.Plan(header);
  absl::StatusOr<std::unique_ptr<RequestStaging>> staging =
      RequestStaging::Lease(plan, header, &system_, &cuda_);
  ASSERT_TRUE(staging.ok()) << staging.status();
  // Inline both ways: the whole source and two double-buffered target layers of K and V.
  EXPECT_EQ((*staging)->AdmissionBytes(),
            plan.source_bytes + 4 * plan.target_geometry.layer_bytes());
  KVT_ASSERT_OK((*staging)->StageCuda(pool_.get()));
  (*staging)->StageSource(pool_.get());
  const CacheView& source = (*staging)->source();
  ASSERT_EQ(source.k.size(), 4u);
  EXPECT_EQ(source.num_tokens, 16);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(source.k[l], (*staging)->SourceLayer(l, 0));
    EXPECT_EQ(source.v[l], (*staging)->SourceLayer(l, 1));
  }
  EXPECT_EQ((*staging)->output_base(), nullptr);
}

TEST_F(StagingTest, PackedRegionsAreReadAndWrittenInPlace) {
  v1::TranslateHeader header = TinyHeader(16);
  TranslatePlan probe = tiny_.Plan(header);
  test::ShmObject input(probe.source_bytes), output(probe.target_bytes);
  const testing::Layers layers = testing::RandomLayers(4, probe.source_geometry, 1);
  const std::string packed = testing::Packed(layers);
  std::memcpy(input.data(), packed.data(), packed.size());
  Register("in", input);
  Register("out", output);
  v1::RegionRef* in = header.mutable_input()->mutable_region();
  in->set_region("in");
  in->set_byte_size(probe.source_bytes);
  v1::RegionRef* out = header.mutable_output()->mutable_region();
  out->set_region("out");
  out->set_byte_size(probe.target_bytes);
  const TranslatePlan plan = tiny_.Plan(header);
  absl::StatusOr<std::unique_ptr<RequestStaging>> staging =
      RequestStaging::Lease(plan, header, &system_, &cuda_);
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ((*staging)->AdmissionBytes(), 0);  // every byte lives in the client's regions
  (*staging)->StageSource(pool_.get());
  // The registry maps the objects itself: the views read its mapping, in place.
  const int64_t layer_bytes = plan.source_geometry.layer_bytes();
  const char* base = static_cast<const char*>((*staging)->source().k[0]);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ((*staging)->source().k[l], base + 2 * l * layer_bytes);
    EXPECT_EQ((*staging)->source().v[l], base + (2 * l + 1) * layer_bytes);
    EXPECT_EQ(std::memcmp((*staging)->source().v[l], layers.v[l].data(), layer_bytes), 0);
  }
  EXPECT_FALSE((*staging)->output_cuda());
  std::memcpy((*staging)->output_base() + 100, "target", 6);
  EXPECT_EQ(std::string(output.data() + 100, 6), "target");
  // A leased region cannot be unregistered while the request holds it.
  EXPECT_EQ(system_.Unregister("in", absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(StagingTest, PagedInputIsGatheredIntoLayerBuffers) {
  v1::TranslateHeader header = TinyHeader(6);
  const TranslatePlan probe = tiny_.Plan(header);
  // Blocks of 4 slots, 3 blocks per layer tensor; the request's tokens in blocks 2 then 0.
  const PagedLayout pages{Layout::kNHD, 3, 4, 2, 32, 4};
  const uint32_t table[] = {2, 0};
  test::ShmObject region(4 * pages.layer_bytes());
  const testing::Layers layers = testing::RandomLayers(4, probe.source_geometry, 2);
  for (int l = 0; l < 4; ++l) {
    char* layer = region.data() + l * pages.layer_bytes();
    ScatterPaged(pages, table, 0, layers.k[l].data(), probe.source_geometry, layer, 0,
                 probe.source_geometry.num_tokens);
    ScatterPaged(pages, table, 1, layers.v[l].data(), probe.source_geometry, layer, 0,
                 probe.source_geometry.num_tokens);
  }
  Register("paged", region);
  v1::RegionRef* in = header.mutable_input()->mutable_region();
  in->set_region("paged");
  in->set_byte_size(region.size());
  in->mutable_paged()->set_num_blocks(3);
  in->mutable_paged()->set_block_size(4);
  for (uint32_t block : table) in->mutable_paged()->add_block_table(block);
  const TranslatePlan plan = tiny_.Plan(header);
  absl::StatusOr<std::unique_ptr<RequestStaging>> staging =
      RequestStaging::Lease(plan, header, &system_, &cuda_);
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ((*staging)->AdmissionBytes(),
            plan.source_bytes + 4 * plan.target_geometry.layer_bytes());
  (*staging)->StageSource(pool_.get());
  const int64_t layer_bytes = plan.source_geometry.layer_bytes();
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(std::memcmp((*staging)->SourceLayer(l, 0), layers.k[l].data(), layer_bytes), 0);
    EXPECT_EQ(std::memcmp((*staging)->source().v[l], layers.v[l].data(), layer_bytes), 0);
  }
}

TEST_F(StagingTest, RegionErrorsNameTheField) {
  v1::TranslateHeader header = TinyHeader(16);
  const TranslatePlan probe = tiny_.Plan(header);
  test::ShmObject input(probe.source_bytes);
  Register("in", input);
  v1::RegionRef* in = header.mutable_input()->mutable_region();
  in->set_region("in");
  in->set_byte_size(probe.source_bytes - 4);
  TranslatePlan plan = tiny_.Plan(header);
  KVT_EXPECT_ERROR(RequestStaging::Lease(plan, header, &system_, &cuda_),
                   absl::StatusCode::kInvalidArgument, "header.input.region.byte_size=");

  in->set_byte_size(probe.source_bytes);
  in->set_region("missing");
  plan = tiny_.Plan(header);
  EXPECT_FALSE(RequestStaging::Lease(plan, header, &system_, &cuda_).ok());

  v1::TranslateHeader paged = TinyHeader(16);
  v1::RegionRef* out = paged.mutable_output()->mutable_region();
  out->set_region("in");
  out->mutable_paged()->set_num_blocks(1);
  out->mutable_paged()->set_block_size(4);  // 16 tokens need 4 blocks
  // The geometry's exact size, so that the check reaches the table (sizes are checked first).
  out->set_byte_size(12288);
  plan = tiny_.Plan(paged);
  KVT_EXPECT_ERROR(RequestStaging::Lease(plan, paged, &system_, &cuda_),
                   absl::StatusCode::kInvalidArgument, "header.output.region.paged.block_table");
  out->set_byte_size(12288 - 4);
  plan = tiny_.Plan(paged);
  KVT_EXPECT_ERROR(RequestStaging::Lease(plan, paged, &system_, &cuda_),
                   absl::StatusCode::kInvalidArgument, "header.output.region.byte_size=12284");
}

}  // namespace
}  // namespace kvt
