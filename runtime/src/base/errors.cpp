#include "kvforge/errors.hpp"

#include <limits>


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

// "targets.slots[2] = 3 is outside [0, 3) (-1 marks padding)"; an open-ended range reads ">= lo".
std::string range_message(const std::string& argument, long long value, long long lo, long long hi, long long index,
                          const std::string& why) {
  std::string m = argument;
  if (index >= 0) m += "[" + std::to_string(index) + "]";
  m += " = " + std::to_string(value);
  if (hi == std::numeric_limits<long long>::max())
    m += " is below " + std::to_string(lo) + " (allowed: >= " + std::to_string(lo) + ")";
  else if (hi - 1 == lo)
    m += " is not " + std::to_string(lo) + " (allowed: " + std::to_string(lo) + ")";
  else
    m += " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
  if (!why.empty()) m += "; " + why;
  return m;
}
}  // namespace

UnknownVariantError::UnknownVariantError(std::string name, std::vector<std::string> nearest)
    : Error(unknown_message(name, nearest)), name_(std::move(name)), nearest_(std::move(nearest)) {}

OutOfRangeError::OutOfRangeError(const std::string& argument, long long value, long long lo, long long hi,
                                 long long index, const std::string& why, const std::string& context)
    : ArgumentError(argument, context + range_message(argument, value, lo, hi, index, why),
                    ArgumentError::whole_message),
      value_(value),
      lo_(lo),
      hi_(hi),
      index_(index) {}

CapacityError::CapacityError(const std::string& argument, int64_t needed, int64_t available, const std::string& context)
    : ArgumentError(argument,
                    context + argument + ": needs " + std::to_string(needed) + ", only " + std::to_string(available) +
                        " available; nothing was allocated",
                    ArgumentError::whole_message),
      needed_(needed),
      available_(available) {}

SpecError::SpecError(std::vector<std::string> errors) : Error([&] {
    std::string m;
    for (const std::string& e : errors) m += (m.empty() ? "" : "\n") + e;
    return m;
  }()), errors_(std::move(errors)) {}

}  // namespace kvforge
