#include "kvforge/device_status.hpp"

#include "kvforge/errors.hpp"

namespace kvforge {

namespace detail {
const char* index_check_argument(int32_t code) {
  switch (code) {
    case kCheckRows: return "targets.rows";
    case kCheckPositions: return "targets.positions";
    case kCheckSlots: return "targets.slots";
    case kCheckPages: return "range.pages";
    case kCheckBeam: return "beam";
    case kCheckBlockPairs: return "pairs";
    case kCheckPageList: return "pages";
    default: return "index";
  }
}

void raise_status(const DeviceStatus& s) {
  throw OutOfRangeError(index_check_argument(s.code), s.value, s.lo, s.hi, s.index,
                        "found by the device-side check; that operation and any queued after it wrote nothing");
}
}  // namespace detail

}  // namespace kvforge
