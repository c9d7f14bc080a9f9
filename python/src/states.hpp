// StatePool for Python: parts from (name, shape, dtype) tuples, parts named or numbered, and each part
// of a layer exported as a [slots, *shape] array over the pool, which a model updates in place.
#pragma once

#include "kvforge/state_pool.hpp"
#include "kvforge/state_shards.hpp"
#include "kvforge/state_slots.hpp"
#include "translate.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

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

// ("layer", "slot", "part") and the like: StatePool checks that each axis is named once.
StateAxes state_axes_named(nb::handle axes) {
  const std::string allowed = " (allowed: an order of slot, layer and part)";
  if (!nb::isinstance<nb::sequence>(axes) || nb::isinstance<nb::str>(axes) || nb::len(axes) != 3)
    throw ArgumentError("axes", "expected three axis names" + allowed);
  StateAxes out = kSlotMajor;
  for (size_t i = 0; i < 3; ++i) {
    std::string word;
    nb::try_cast(nb::borrow<nb::sequence>(axes)[i], word);
    const auto* names = std::begin(kStateAxisNames);
    const auto* at = std::find_if(names, std::end(kStateAxisNames), [&](const char* n) { return word == n; });
    if (at == std::end(kStateAxisNames)) throw ArgumentError("axes", "'" + word + "' is not a state axis" + allowed);
    out[i] = StateAxis(at - names);
  }
  return out;
}

nb::tuple state_axes_tuple(const StateAxes& a) { return nb::make_tuple(name_of(a[0]), name_of(a[1]), name_of(a[2])); }

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

// StatePool, and StateSlots over a SequenceManager (kvforge.StatePool, kvforge.StateSlots).
void bind_states(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<StatePool>(m, "StatePool")
      .def("__init__", [](StatePool* self, nb::handle parts, int layers, int64_t slots, const std::string& device,
                          int64_t checkpoints, uintptr_t stream, nb::handle axes) {
        new (self) StatePool(state_parts(parts), layers,
                             StatePoolConfig{device_named(device), slots, checkpoints, reinterpret_cast<void*>(stream)},
                             axes.is_none() ? kSlotMajor : state_axes_named(axes));
      }, "parts"_a, "layers"_a, "slots"_a, "device"_a = "cpu", "checkpoints"_a = 0, "stream"_a = 0, "axes"_a = nb::none(),
         "A pool of its own: `slots` states (and `checkpoints` records) of `layers` layers, each a record of "
         "parts (name, shape, dtype). axes orders its memory, outermost first: ('slot', 'layer', 'part') by "
         "default, ('layer', 'slot', 'part') as vLLM, ('part', 'layer', 'slot') as SGLang.")
      .def_static("for_variant", [](const VariantDescriptor& d, int64_t slots, const std::string& device, int64_t checkpoints) {
        return new StatePool(d, StatePoolConfig{device_named(device), slots, checkpoints, nullptr});
      }, "descriptor"_a, "slots"_a, "device"_a = "cpu", "checkpoints"_a = 0,
         "The pool of a variant whose model spec names linear_layers: its state record over those layers, in "
         "its layout's state_axes.")
      .def_static("in_pages_of", [](Cache& cache, nb::handle parts, std::optional<int> layers, int64_t checkpoints) {
        if (parts.is_none()) return new StatePool(cache, checkpoints);
        if (!layers) throw ArgumentError("layers", "is required with parts: the linear layers the record is kept for");
        return new StatePool(state_parts(parts), *layers, cache, checkpoints);
      }, "cache"_a, "parts"_a = nb::none(), "layers"_a = nb::none(), "checkpoints"_a = 0, nb::keep_alive<0, 1>(),
         "The states in a paged cache's own pages: slot s is page s, taken from the same free list as K/V "
         "(StateSlots takes them from the SequenceManager). parts and layers default to the record of the "
         "cache's variant (its model's linear_layers); checkpoints caps the pages StateSlots keeps checkpoints "
         "in. ShapeError('cache') names the page size that would hold the record where a page is too small.")
      .def_prop_ro("in_pages", &StatePool::in_pages)
      .def_prop_ro("axes", [](const StatePool& s) { return state_axes_tuple(s.axes()); })
      .def("offset", [](const StatePool& s, int64_t slot, int layer, nb::handle part) {
        return s.offset(slot, layer, state_part(s, part));
      }, "slot"_a, "layer"_a, "part"_a,
           "Bytes from buffer() (in pages: from the cache's storage) to one part of one layer of a slot; "
           "slots + i is checkpoint record i of a pool of its own.")
      .def("slot_stride", [](const StatePool& s, int layer, nb::handle part) { return s.slot_stride(layer, state_part(s, part)); },
           "layer"_a, "part"_a, "Bytes from one slot's part to the next slot's.")
      .def_prop_ro("page_bytes", &StatePool::page_bytes)
      .def_prop_ro("page_padding_bytes", &StatePool::page_padding_bytes)
      .def_prop_ro("parts", [](const StatePool& s) {
        nb::list out;
        for (const StatePart& p : s.parts()) out.append(nb::make_tuple(p.name, nb::tuple(nb::cast(p.shape)), name(p.dtype)));
        return out;
      })
      .def_prop_ro("layers", &StatePool::layers)
      .def_prop_ro("slots", [](const StatePool& s) { return s.config().slots; })
      .def_prop_ro("checkpoints", [](const StatePool& s) { return s.config().checkpoints; })
      .def_prop_ro("device", [](const StatePool& s) { return name_of(s.config().device); })
      .def_prop_ro("slot_bytes", &StatePool::slot_bytes)
      .def_prop_ro("record_bytes", &StatePool::record_bytes)
      .def_prop_ro("bytes", &StatePool::bytes)
      .def_prop_ro("padding_bytes", &StatePool::padding_bytes)
      .def("buffer", [](nb::handle self) {
        const StatePool& s = nb::cast<const StatePool&>(self);
        if (s.in_pages()) throw UnsupportedError("buffer: the states lie in the cache's pages; register the cache's storage");
        return export_array(s.data(), DType::i8, s.config().device, {size_t(s.bytes())}, {1}, self);
      }, "The pool's memory as flat bytes (slots, then checkpoints), for registering with a transport.")
      .def("part_bytes", [](const StatePool& s, nb::handle part) { return s.part_bytes(state_part(s, part)); }, "part"_a)
      .def("view", [](nb::handle self, int layer, nb::handle part) {
        const StatePool& s = nb::cast<const StatePool&>(self);
        return state_view(s, layer, state_part(s, part), self);
      }, "layer"_a, "part"_a)
      .def("write", [](StatePool& s, int64_t slot, int layer, nb::handle part, nb::handle src) {
        const int p = state_part(s, part);
        Device device;
        const void* data = state_array(s, p, src, "src", Access::read, device);
        nb::gil_scoped_release unlocked;
        s.write(slot, layer, p, data, device);
      }, "slot"_a, "layer"_a, "part"_a, "src"_a)
      .def("read", [](const StatePool& s, int64_t slot, int layer, nb::handle part, nb::handle dst) {
        const int p = state_part(s, part);
        Device device;
        void* data = state_array(s, p, dst, "dst", Access::written, device);
        nb::gil_scoped_release unlocked;
        s.read(slot, layer, p, data, device);
      }, "slot"_a, "layer"_a, "part"_a, "dst"_a)
      .def("copy_slot", &StatePool::copy_slot, "src"_a, "dst"_a, Release())
      .def("zero_slot", &StatePool::zero_slot, "slot"_a, Release())
      .def("checkpoint", &StatePool::checkpoint, "slot"_a, "index"_a, Release())
      .def("restore", &StatePool::restore, "index"_a, "slot"_a, Release())
      .def("synchronize", &StatePool::synchronize, Release());
  // A state between tensor-parallel groups (state_shards.hpp), for transports that move it themselves.
  auto shards_of = [](const VariantDescriptor& d, int sender_tp, int receiver_tp) {
    for (auto [name, tp] : {std::pair{"sender_tp", sender_tp}, std::pair{"receiver_tp", receiver_tp}})
      if (tp < 1 || tp > 1024) throw OutOfRangeError(name, tp, 1, 1025);
    return StateShards(state_parts(d), d.states->num_linear, d, d.tensor_parallel, sender_tp, receiver_tp, "descriptor");
  };
  m.def("state_rows", [shards_of](const VariantDescriptor& d, int sender_tp, int receiver_tp, int sender, int receiver) {
    if (sender < 0 || sender >= sender_tp) throw OutOfRangeError("sender", sender, 0, sender_tp);
    if (receiver < 0 || receiver >= receiver_tp) throw OutOfRangeError("receiver", receiver, 0, receiver_tp);
    nb::list out;
    for (const StateRow& r : shards_of(d, sender_tp, receiver_tp).rows(sender, receiver))
      out.append(nb::make_tuple(r.layer, r.part, r.sender_offset, r.receiver_offset, r.bytes));
    return out;
  }, "descriptor"_a, "sender_tp"_a, "receiver_tp"_a, "sender"_a, "receiver"_a,
        "What sender rank `sender` of a group of degree sender_tp gives receiver rank `receiver` of one of "
        "receiver_tp of a sequence's state, for the model of `descriptor` (a variant with linear_layers, at "
        "either degree): (layer, part, sender_offset, receiver_offset, bytes) rows, the offsets from the part's "
        "start on each side. Each part splits as the model spec's shard_axis says; a part whole on every rank "
        "comes from the sender of the receiver's first piece of heads.");
  m.def("state_model_hash", [shards_of](const VariantDescriptor& d) { return shards_of(d, 1, 1).model_record_hash(); },
        "descriptor"_a, "A hash of the model's state record (layers, and each part's name, dtype, split and the model's "
        "shape), the same at every degree: two shards of one model agree.");
  m.def("state_page_size", [](const VariantDescriptor& d, nb::handle parts, std::optional<int> layers) {
    if (parts.is_none()) return state_page_size(d);
    if (!layers) throw ArgumentError("layers", "is required with parts: the linear layers the record is kept for");
    return state_page_size(d, state_parts(parts), *layers);
  }, "descriptor"_a, "parts"_a = nb::none(), "layers"_a = nb::none(),
        "The fewest tokens a page of the variant's layout must hold for one page to hold a whole state record "
        "(StatePool.in_pages_of): its model's, or `parts` in each of `layers` layers; the smallest multiple of its "
        "page size that fits, or 0 where none does.");
  nb::class_<StateSlots>(m, "StateSlots")
      .def(nb::init<SequenceManager&, StatePool&, int32_t>(), "manager"_a, "pool"_a, "every"_a, nb::keep_alive<1, 2>(),
           nb::keep_alive<1, 3>())
      .def("reusable_prefix", &StateSlots::reusable_prefix, "prompt"_a, "salt"_a = nb::none())
      .def("add", &StateSlots::add, "seq"_a, "prompt"_a, "salt"_a = nb::none(), Release())
      .def("attach", &StateSlots::attach, "seq"_a,
           "A sequence the manager holds but this does not (its pages came by a transfer or a pull) gets a zeroed "
           "slot; returns it.")
      .def("fork", &StateSlots::fork, "parent"_a, "child"_a, Release())
      .def("free", &StateSlots::free, "seq"_a)
      .def("offload", &StateSlots::offload, "seq"_a, Release())
      .def("restore", &StateSlots::restore, "seq"_a, Release())
      .def("checkpoint", &StateSlots::checkpoint, "seq"_a, Release())
      .def("next_boundary", &StateSlots::next_boundary, "seq"_a)
      .def("slot", &StateSlots::slot, "seq"_a)
      .def_prop_ro("every", &StateSlots::every)
      .def_prop_ro("free_slots", &StateSlots::free_slots)
      .def_prop_ro("checkpoints_held", &StateSlots::checkpoints_held)
      .def_prop_ro("stats", [](const StateSlots& s) {
        nb::dict f;
        f["checkpoints"] = s.stats().checkpoints, f["restores"] = s.stats().restores, f["replaced"] = s.stats().replaced;
        f["capped_tokens"] = s.stats().capped_tokens, f["reclaimed"] = s.stats().reclaimed;
        return f;
      });
}

}  // namespace
}  // namespace kvforge
