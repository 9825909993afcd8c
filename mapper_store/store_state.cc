#include "mapper_store/store_state.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvt {
namespace store_internal {

void StoreState::Fire(Aftermath& after) {
  {
    MutexLock lock(&events_mu);
    if (events.page_in) {
      for (const auto& e : after.page_ins) events.page_in(*e.mapper, e.place, e.seconds);
    }
    if (events.eviction) {
      for (const auto& e : after.evictions) events.eviction(*e.mapper, e.place);
    }
    if (events.access) {
      for (const auto& e : after.accesses) events.access(*e.mapper, e.place, e.hit);
    }
  }
  after = Aftermath();
}

SameLock::SameLock(const Mutex& held, const Mutex& alias) {
  if (&held != &alias) std::abort();  // two mutexes: the annotations would lie
}

void WaitOnce(CondVar& changed, Mutex* mu, absl::Time deadline) {
  // Bounded even without a deadline, so a missed wake-up costs a second, not a hang.
  changed.WaitWithDeadline(mu, std::min(deadline, absl::Now() + absl::Seconds(1)));
}

void FillFromManifest(const Manifest& m, MapperInfo* info) {
  info->source_model = m.source.name;
  info->target_model = m.target.name;
  info->kind = MapperKindName(m.kind);
  info->k = m.k;
  info->window = m.window;
  info->synthetic = m.synthetic;
  info->weight_dtype = m.weights_dtype;
  info->source = m.source;
  info->target = m.target;
  info->num_params = MapperNumParams(m);
}

std::string Bytes(uint64_t bytes) {
  return absl::StrCat(bytes, " bytes (", absl::StrFormat("%.1f", bytes / 1048576.0), " MiB)");
}

}  // namespace store_internal
}  // namespace kvt
