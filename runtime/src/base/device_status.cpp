#include "kvforge/detail/device_status.hpp"

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
    case kCheckRingLength: return "range";
    default: return "index";
  }
}

void raise_status(const DeviceStatus& s) {
  if (s.code == kCheckRingLength)
    throw OutOfRangeError("range", s.value, s.lo, s.hi, -1,
                          "the ring row holds " + std::to_string(s.value) +
                              " positions, so this range needs a row length in [" + std::to_string(s.lo) + ", " +
                              std::to_string(s.hi - 1) + "]: positions at or past the length were never written, and "
                              "those before length - window have left the window; found by the device-side check, "
                              "and that operation and any queued after it wrote nothing");
  throw OutOfRangeError(index_check_argument(s.code), s.value, s.lo, s.hi, s.index,
                        "found by the device-side check; that operation and any queued after it wrote nothing");
}
}  // namespace detail

}  // namespace kvforge
