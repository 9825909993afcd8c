#include "mapper_store/store_types.h"

namespace kvt {

const char* MapperStateName(MapperState state) {
  switch (state) {
    case MapperState::kDiscovered:
      return "DISCOVERED";
    case MapperState::kLoading:
      return "LOADING";
    case MapperState::kHostResident:
      return "HOST_RESIDENT";
    case MapperState::kDeviceResident:
      return "DEVICE_RESIDENT";
    case MapperState::kFailed:
      return "FAILED";
  }
  return "?";
}

}  // namespace kvt
