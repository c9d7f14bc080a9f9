#include "kvforge/collective.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "kvforge/errors.hpp"

namespace kvforge {
namespace {

// The classes an agreed error keeps, so that every rank can catch what the failing rank raised.
enum class Kind : int64_t { error, argument, out_of_range, capacity, state, unsupported, backend, transfer };

// What crosses between ranks: the class, the argument (or field) it names, its figures, and its message.
struct Failure {
  Kind kind = Kind::error;
  std::string argument, message;
  int64_t figures[4] = {0, 0, 0, -1};  // OutOfRange: value, lo, hi, index; Capacity: needed, available
};

Failure describe(std::exception_ptr error) {
  Failure f;
  try {
    std::rethrow_exception(error);
  } catch (const CapacityError& e) {
    f.kind = Kind::capacity, f.argument = e.argument(), f.figures[0] = e.needed(), f.figures[1] = e.available();
    f.message = e.what();
  } catch (const OutOfRangeError& e) {
    f.kind = Kind::out_of_range, f.argument = e.argument();
    f.figures[0] = e.value(), f.figures[1] = e.lo(), f.figures[2] = e.hi(), f.figures[3] = e.index();
    f.message = e.what();
  } catch (const StateError& e) {
    f.kind = Kind::state, f.argument = e.argument(), f.message = e.what();
  } catch (const ArgumentError& e) {
    f.kind = Kind::argument, f.argument = e.argument(), f.message = e.what();
  } catch (const TransferError& e) {
    f.kind = Kind::transfer, f.argument = e.field(), f.message = e.what();
  } catch (const UnsupportedError& e) {
    f.kind = Kind::unsupported, f.message = e.what();
  } catch (const BackendError& e) {
    f.kind = Kind::backend, f.message = e.what();
  } catch (const std::exception& e) {
    f.message = e.what();
  } catch (...) {
    f.message = "an exception that is not a std::exception";
  }
  return f;
}

// One value from rank `from` to every rank: the others offer the largest int64, so the minimum is its.
int64_t from_rank(Transport& ranks, int from, int64_t value) {
  return ranks.all_min(ranks.rank() == from ? value : INT64_MAX);
}

std::string text_from_rank(Transport& ranks, int from, const std::string& text) {
  const int64_t length = from_rank(ranks, from, int64_t(text.size()));
  std::string out(size_t(length), '\0');
  for (int64_t at = 0; at < length; at += 8) {
    int64_t word = 0;
    if (ranks.rank() == from) std::memcpy(&word, text.data() + at, size_t(std::min<int64_t>(8, length - at)));
    word = from_rank(ranks, from, word);
    std::memcpy(&out[size_t(at)], &word, size_t(std::min<int64_t>(8, length - at)));
  }
  return out;
}

// Every rank raises the failing rank's class, naming the same argument, with the message saying which
// rank it came from.
[[noreturn]] void raise(const Failure& f, const std::string& where) {
  const std::string message = where + f.message;
  const int64_t* n = f.figures;
  switch (f.kind) {
    case Kind::capacity: throw CapacityError(f.argument, n[0], n[1], where);
    case Kind::out_of_range: {
      const std::string plain = OutOfRangeError(f.argument, n[0], n[1], n[2], n[3]).what();
      const std::string why = f.message.size() > plain.size() + 2 ? f.message.substr(plain.size() + 2) : "";
      throw OutOfRangeError(f.argument, n[0], n[1], n[2], n[3], why, where);
    }
    case Kind::state: throw StateError(f.argument, message, ArgumentError::whole_message);
    case Kind::argument: throw ArgumentError(f.argument, message, ArgumentError::whole_message);
    case Kind::transfer: throw TransferError(f.argument, where + f.message.substr(f.argument.size() + 2));
    case Kind::unsupported: throw UnsupportedError(message);
    case Kind::backend: throw BackendError(message);
    case Kind::error: break;
  }
  throw Error(message);
}

}  // namespace

void agree_on_outcome(Transport& ranks, std::exception_ptr mine) {
  const int64_t failed = ranks.all_min(mine ? int64_t(ranks.rank()) : INT64_MAX);
  if (failed == INT64_MAX) return;
  const int from = int(failed);
  Failure f;
  if (ranks.rank() == from) f = describe(mine);
  f.kind = Kind(from_rank(ranks, from, int64_t(f.kind)));
  for (int64_t& figure : f.figures) figure = from_rank(ranks, from, figure);
  f.argument = text_from_rank(ranks, from, f.argument);
  f.message = text_from_rank(ranks, from, f.message);
  raise(f, "rank " + std::to_string(from) + " of " + std::to_string(ranks.size()) + ": ");
}

}  // namespace kvforge
