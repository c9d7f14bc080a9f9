// StatePool for Python: parts from (name, shape, dtype) tuples, parts named or numbered, and each part
// of a layer exported as a [slots, *shape] array over the pool, which a model updates in place.
#pragma once

#include "kvforge/state_pool.hpp"
#include "translate.hpp"

namespace kvforge {
namespace {

std::vector<StatePart> state_parts(nb::handle parts) {
  if (!nb::isinstance<nb::sequence>(parts) || nb::isinstance<nb::str>(parts))
    throw ArgumentError("parts", "expected a list of (name, shape, dtype) tuples");
  std::vector<StatePart> out;
  const nb::sequence items = nb::borrow<nb::sequence>(parts);
  for (size_t i = 0; i < nb::len(items); ++i) {
    const std::string at = "parts[" + std::to_string(i) + "]";
    const nb::handle item = items[i];
    if (!nb::isinstance<nb::sequence>(item) || nb::isinstance<nb::str>(item) || nb::len(item) != 3)
      throw ArgumentError(at, "expected a (name, shape, dtype) tuple");
    StatePart p;
    if (!nb::try_cast(item[0], p.name)) throw ArgumentError(at + ".name", "expected a string");
    if (!nb::isinstance<nb::sequence>(item[1]) || nb::isinstance<nb::str>(item[1]))
      throw ShapeError(at + ".shape", "expected a tuple of extents");
    for (nb::handle e : nb::borrow<nb::sequence>(item[1])) {
      int64_t extent = 0;
      if (!nb::try_cast(e, extent)) throw ShapeError(at + ".shape", "expected integer extents");
      p.shape.push_back(extent);
    }
    std::string dtype;
    if (!nb::try_cast(item[2], dtype)) throw DtypeError(at + ".dtype", "expected a dtype name (fp32, fp16, bf16)");
    p.dtype = *dtype_named(dtype, (at + ".dtype").c_str());
    out.push_back(std::move(p));
  }
  return out;
}

int state_part(const StatePool& pool, nb::handle part) {
  std::string name;
  if (nb::try_cast(part, name)) return pool.part_index(name);
  int64_t index = 0;
  if (!nb::try_cast(part, index)) throw ArgumentError("part", "expected a part's name or index");
  if (index < 0 || index >= int64_t(pool.parts().size())) throw OutOfRangeError("part", index, 0, int64_t(pool.parts().size()));
  return int(index);
}

Exported state_view(const StatePool& pool, int layer, int part, nb::handle owner) {
  const StateView v = pool.view(layer, part);
  return export_array(v.data, v.dtype, v.device, std::vector<size_t>(v.shape.begin(), v.shape.end()), v.strides, owner);
}

// One part of one slot, from or into a contiguous array of the part's shape and dtype.
void* state_array(const StatePool& pool, int part, nb::handle obj, const char* argument, Access access, Device& device) {
  const ArrayArg a = array_arg(obj, argument, access);
  const StatePart& p = pool.parts()[size_t(part)];
  std::string want = "[";
  for (size_t d = 0; d < p.shape.size(); ++d) want += (d ? ", " : "") + std::to_string(p.shape[d]);
  want += "]";
  bool same = a.t.ndim == int(p.shape.size());
  int64_t step = 1;
  for (int d = a.t.ndim - 1; same && d >= 0; --d) {
    same = a.shape(d) == p.shape[size_t(d)] && (a.shape(d) == 1 || a.stride(d) == step);
    step *= a.shape(d);
  }
  if (!same) throw ShapeError(argument, "must be a contiguous array of part '" + p.name + "''s shape " + want);
  if (dtype_of_array(a, argument) != p.dtype)
    throw DtypeError(argument, "must be " + std::string(dtype_name(p.dtype)) + ", part '" + p.name + "''s dtype");
  device = device_of_array(a, argument);
  return a.data();
}

}  // namespace
}  // namespace kvforge
