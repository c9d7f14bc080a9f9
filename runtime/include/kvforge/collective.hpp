// Collective calls that fail together. A rank that cannot go on must still join the agreement, or every
// other rank waits for it forever; so each rank runs its own part, catches what it raises, and then all
// ranks agree on the outcome through Transport::all_min, the one collective every transport has.
#pragma once

#include <exception>
#include <utility>

#include "kvforge/transport.hpp"

namespace kvforge {

// Collective over every rank of `ranks`: `mine` is this rank's outcome (null: it succeeded). Returns on
// every rank when all succeeded. Otherwise every rank throws the same error, the lowest failing rank's:
// of its class (CapacityError, OutOfRangeError, ... keeping their figures), its message prefixed with
// "rank R of N: ".
void agree_on_outcome(Transport& ranks, std::exception_ptr mine);

// Runs `part` on this rank, then agrees on the outcome across `ranks` (agree_on_outcome): returns what
// `part` returned where every rank succeeded, and throws the same error on every rank where one failed.
template <class Part> auto collectively(Transport& ranks, Part&& part) -> decltype(part()) {
  std::exception_ptr error;
  decltype(part()) result{};
  try {
    result = std::forward<Part>(part)();
  } catch (...) {
    error = std::current_exception();
  }
  agree_on_outcome(ranks, error);
  return result;
}

}  // namespace kvforge
