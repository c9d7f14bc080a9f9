// The physical wire format (kvforge/physical_wire.hpp) for kvforge.nixl's prepared pulls: the receiver
// describes where a request's values go in its pool, and the sender writes a layer that way in one
// pass. A placement crosses processes, so write_physical checks it whole before writing a byte.
#pragma once

#include "kvforge/physical_wire.hpp"
#include "translate.hpp"

namespace kvforge {
namespace {

nb::object placement_dict(const std::optional<PhysicalPlacement>& p) {
  if (!p) return nb::none();
  nb::dict f;
  f["page_size"] = p->page_size, f["slot_stride"] = p->slot_stride, f["head_stride"] = p->head_stride;
  f["pages"] = p->pages, f["head_blocks"] = p->head_blocks, f["wire_bytes"] = p->wire_bytes;
  f["block"] = owned_array(p->block), f["runs"] = owned_array(p->runs), f["run_at"] = owned_array(p->run_at);
  return f;
}

std::vector<int64_t> int64_list(nb::handle obj, const char* argument) {
  const ArrayArg a = array_arg(obj, argument, Access::read);
  if (a.t.ndim != 1 || dtype_of_array(a, argument) != DType::i64 || device_of_array(a, argument) != Device::cpu ||
      (a.shape(0) > 1 && a.stride(0) != 1))
    throw ShapeError(argument, "expected a contiguous 1-D int64 host array");
  const auto* at = static_cast<const int64_t*>(a.data());
  return std::vector<int64_t>(at, at + a.shape(0));
}

PhysicalPlacement placement_from(const nb::dict& f) {
  PhysicalPlacement p;
  const auto field = [&](const char* name) -> int64_t {
    if (!f.contains(name)) throw ArgumentError(std::string("placement.") + name, "missing");
    int64_t value = 0;
    if (!nb::try_cast<int64_t>(f[name], value)) throw ArgumentError(std::string("placement.") + name, "must be an integer");
    return value;
  };
  p.page_size = field("page_size"), p.slot_stride = field("slot_stride"), p.head_stride = field("head_stride");
  p.pages = field("pages"), p.head_blocks = field("head_blocks"), p.wire_bytes = field("wire_bytes");
  if (!f.contains("block") || !f.contains("runs")) throw ArgumentError("placement", "needs block and runs arrays");
  p.block = int64_list(f["block"], "placement.block");
  p.runs = int64_list(f["runs"], "placement.runs");
  return p;
}

// The one pass of the sender: checks everything (the cache, the range, the heads, the placement, the
// wire's size), then writes with the GIL released.
void write_physical_from(const Cache& c, int layer, int64_t tokens, const nb::dict& placement, nb::handle out,
                         const IndexView& pages, int64_t row, int64_t head_offset, int64_t heads) {
  const VariantDescriptor& d = c.descriptor();
  if (!d.plain_values() || d.is_hybrid() || c.config().device != Device::cpu)
    throw UnsupportedError(std::string("cache: ") + d.name + ": the physical format reads unquantized, non-hybrid host caches");
  if (tokens < 1) throw OutOfRangeError("tokens", tokens, 1, int64_t(1) << 40);
  if (heads < 0) heads = d.heads - head_offset;
  if (head_offset < 0 || head_offset >= d.heads) throw OutOfRangeError("head_offset", head_offset, 0, d.heads);
  if (heads < 1 || head_offset + heads > d.heads) throw OutOfRangeError("heads", heads, 1, d.heads - head_offset + 1);
  const GatherRange range{row, pages, 0, tokens};
  check_physical_range(c, range, tokens);
  const PhysicalPlacement p = placement_from(placement);
  const LayerView view = c.view(layer);
  const std::string problem = placement_problem(p, tokens, int(heads), d.head_dim, dtype_size(view.dtype));
  if (!problem.empty()) throw ArgumentError("placement", "has " + problem);
  const ArrayArg wire = array_arg(out, "out", Access::written);
  if (wire.t.ndim != 1 || (wire.shape(0) > 1 && wire.stride(0) != 1)) throw ShapeError("out", "must be a contiguous 1-D byte array");
  if (wire.nbytes() < p.wire_bytes)
    throw ShapeError("out", "holds " + std::to_string(wire.nbytes()) + " bytes; the placement needs " + std::to_string(p.wire_bytes));
  if (device_of_array(wire, "out") != Device::cpu) throw DeviceError("out", "must be host memory");
  nb::gil_scoped_release unlocked;
  write_physical(view, d.paged() ? static_cast<const int32_t*>(pages.data) : nullptr, d.page_size, row, int(head_offset),
                 int(heads), tokens, d.head_dim, p, static_cast<char*>(wire.data()));
}

}  // namespace
}  // namespace kvforge
