// What a step changed in the persistent block table, as the host records it and the step's kernels
// (step_build.hpp) apply it: plain records, so that step_state.hpp declares its queues without the
// kernels.
#pragma once

#include <cstdint>

namespace kvforge::detail {

// One entry of the persistent block table written since the last step.
struct TableWrite {
  int32_t row;    // the sequence's table row
  int32_t index;  // its page index
  int32_t page;   // the page there now (-1: left the window, or offloaded)
};

// A table row whose length or first held page the device must be told: a new or restored sequence,
// one added over a cached prefix, one whose window freed pages.
struct RowWrite {
  int32_t row;
  int32_t length;   // tokens held before this step's new tokens
  int32_t dropped;  // leading entries freed by the window
};

}  // namespace kvforge::detail
