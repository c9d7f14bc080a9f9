// Typed errors. Every check runs before the first write, so a caught error leaves the cache as it was.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvforge {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The variant asked for is not registered; `nearest()` lists the closest names.
class UnknownVariantError : public Error {
 public:
  UnknownVariantError(std::string name, std::vector<std::string> nearest);
  const std::string& name() const { return name_; }
  const std::vector<std::string>& nearest() const { return nearest_; }

 private:
  std::string name_;
  std::vector<std::string> nearest_;
};

// An argument is wrong; `argument()` names it. The subclasses say how.
class ArgumentError : public Error {
 public:
  ArgumentError(std::string argument, const std::string& message)
      : Error(argument + ": " + message), argument_(std::move(argument)) {}
  const std::string& argument() const { return argument_; }
  // For messages that already name the argument in their own words (subclasses, and an error agreed
  // across ranks, collective.hpp, whose message says which rank raised it).
  enum WholeMessage { whole_message };
  ArgumentError(std::string argument, const std::string& message, WholeMessage)
      : Error(message), argument_(std::move(argument)) {}

 private:
  std::string argument_;
};

// A value lies outside [lo, hi); for index arrays, `index()` is the first offending element. The message
// reads "targets.slots[2] = 3 is outside [0, 3)"; hi = LLONG_MAX means no upper bound (">= lo").
class OutOfRangeError : public ArgumentError {
 public:
  // `context` goes before the message ("rank 2 of 4: ").
  OutOfRangeError(const std::string& argument, long long value, long long lo, long long hi,
                  long long index = -1, const std::string& why = "", const std::string& context = "");
  long long value() const { return value_; }
  long long lo() const { return lo_; }
  long long hi() const { return hi_; }
  long long index() const { return index_; }

 private:
  long long value_, lo_, hi_, index_;
};

class ShapeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

class DtypeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

class DeviceError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// An allocation cannot be met; nothing was allocated. `argument()` names what ran short.
class CapacityError : public ArgumentError {
 public:
  CapacityError(const std::string& argument, int64_t needed, int64_t available, const std::string& context = "");
  int64_t needed() const { return needed_; }
  int64_t available() const { return available_; }

 private:
  int64_t needed_, available_;
};

// The object an argument names is in the wrong state for the call (a block that is already free, a
// sequence that is offloaded or unknown); nothing changed.
class StateError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// The operation does not exist for this layout (for example reorder on a paged cache).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

// A CUDA call failed, or CUDA was asked for where it is not built or no device is present; or a
// variant built on demand could not be compiled (no compiler, a failed build).
class BackendError : public Error {
 public:
  using Error::Error;
};

// A transfer was refused or did not complete; nothing of it was committed. `field()` names what
// disagreed (a header field, "timeout", ...).
class TransferError : public Error {
 public:
  TransferError(std::string field, const std::string& message) : Error(field + ": " + message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// A spec is invalid (a variant built on demand). `errors()` lists every `file:line: field: problem
// (allowed: ...)` at once; the message joins them, one a line.
class SpecError : public Error {
 public:
  explicit SpecError(std::vector<std::string> errors);
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::vector<std::string> errors_;
};

}  // namespace kvforge
