// The device status word: where a failed index check records itself, and how the host turns it into
// the typed error a CPU check would have thrown. One place for the word, its codes and their decoding.
#pragma once

#include <cstdint>

namespace kvforge::detail {

// Device-side record of the first failed index check. CUDA cannot read targets on the host without
// breaking graph capture, so its checks run on the device: every later kernel sees a non-zero code and
// writes nothing, and the host raises the error at synchronize(). The CPU checks on the host instead.
struct DeviceStatus {
  int32_t code;  // 0: fine; else an IndexCheck value
  int32_t unused;
  int64_t index;
  int64_t value;
  int64_t lo;
  int64_t hi;
};

enum IndexCheck : int32_t {
  kCheckNone = 0,
  kCheckRows,
  kCheckPositions,
  kCheckSlots,
  kCheckPages,
  kCheckBeam,
  kCheckBlockPairs,
  kCheckPageList,
  kCheckRingLength,  // a ring gather's range against the row's length (value: the length)
};
// The argument a failed check of this kind names.
const char* index_check_argument(int32_t code);
// Throws the OutOfRangeError a recorded failure stands for (synchronize() calls it).
[[noreturn]] void raise_status(const DeviceStatus& s);

}  // namespace kvforge::detail
