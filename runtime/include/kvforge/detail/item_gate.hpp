// The gate an item body passes before it writes: the status word and the call's index checks, read
// at once with the body's own loads (ItemGate). Executors call gated bodies; ops.hpp writes them.
#pragma once

#include <cstdint>

#include "kvforge/detail/config.hpp"
#include "kvforge/detail/device_status.hpp"
#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

// The one gate before an item body writes. A body given one (through gated()) first issues every
// load that needs no checked index (its inputs, its targets' entries), then asks closed() once,
// together with every other thread of its block, and writes nothing if it says so. closed() reads
// the status word, after the checks of this call, so that on a GPU the body's loads, the status word
// and the checks' loads are all in flight at once: one wait on memory where there were three.
struct ItemGate {
  // The checks this block runs itself (CUDA, calls short enough); null where they ran before the
  // launch, or run in a CUDA launch just before it that this one may overlap (wait_for_prior_grid).
  const IndexChecks* checks = nullptr;

  // The target answers (target::gate_closed): the host reads the status word; a device's block also
  // runs `checks` together, or waits for the launch that ran them.
  KVF_HD KVF_INLINE bool closed(const DeviceStatus* status) const { return target::gate_closed(checks, status); }
};

// An item body that takes an ItemGate: body(item, lane, lanes, gate). Called as a plain body, its gate
// only reads the status word, so that executors that check before they loop (the CPU's) run it
// unchanged.
template <class Body> struct Gated {
  Body body;
  KVF_HD KVF_INLINE void operator()(int64_t item, int lane, int lanes) const { body(item, lane, lanes, ItemGate{}); }
};
template <class Body> Gated<Body> gated(Body body) { return Gated<Body>{body}; }
template <class Body> struct IsGated { static constexpr bool value = false; };
template <class Body> struct IsGated<Gated<Body>> { static constexpr bool value = true; };

}  // namespace kvforge::detail
