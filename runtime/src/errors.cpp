#include "kvforge/errors.hpp"

#include "kvforge/op_args.hpp"

namespace kvforge {

namespace {
std::string unknown_message(const std::string& name, const std::vector<std::string>& nearest) {
  std::string m = "unknown variant '" + name + "'";
  if (!nearest.empty()) {
    m += "; nearest: ";
    for (size_t i = 0; i < nearest.size(); ++i) m += (i ? ", " : "") + nearest[i];
  }
  return m;
}

std::string range_message(long long value, long long lo, long long hi, long long index, const std::string& why) {
  std::string m = std::to_string(value) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
  if (index >= 0) m = "element " + std::to_string(index) + " is " + m;
  if (!why.empty()) m += ": " + why;
  return m;
}
}  // namespace

UnknownVariantError::UnknownVariantError(std::string name, std::vector<std::string> nearest)
    : Error(unknown_message(name, nearest)), name_(std::move(name)), nearest_(std::move(nearest)) {}

OutOfRangeError::OutOfRangeError(const std::string& argument, long long value, long long lo, long long hi,
                                 long long index, const std::string& why)
    : ArgumentError(argument, range_message(value, lo, hi, index, why)),
      value_(value),
      lo_(lo),
      hi_(hi),
      index_(index) {}

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
