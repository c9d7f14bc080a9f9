// kvforge._native: the runtime's public API (kvforge.hpp) for Python, over DLPack. This file only
// translates: DLPack arrays in and out as the runtime's views, Python values as its config structs,
// its typed errors as the Python classes of kvforge/errors.py. Every check stays in the runtime, so a
// refused call raises before anything is written, as from C++. It is torch-free: any __dlpack__
// producer goes in, and what comes out is a DLPack-capable array torch.from_dlpack() or numpy take.
// nanobind's ndarray is the one FFI type here, so another binding layer would change only this file.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <deque>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "kvforge/memory_plan.hpp"
#include "kvforge/quant.hpp"
#include "kvforge/sequence_manager.hpp"
#include "kvforge/shard.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvforge {
namespace {

using Array = nb::ndarray<nb::device::none>;              // any device, dtype, shape and strides
using ReadArray = nb::ndarray<nb::ro, nb::device::none>;  // the same, read-only ones too
using Exported = nb::ndarray<nb::array_api>;  // what goes out: an object with __dlpack__, no framework

// ---- DLPack in ----

// The C exchange table of DLPack 1.x (dlpack.h's DLPackExchangeAPI, declared here up to the one entry
// kvforge calls). A producer sets it on its type as __dlpack_c_exchange_api__; filling a DLTensor
// through it costs tens of nanoseconds, where calling __dlpack__() costs about 2 us per array.
struct ExchangeApi {
  struct {
    uint32_t major, minor;
  } version;
  const void* prev_api;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
};

// The exchange table of `obj`'s type, or null; looked up once per type.
const ExchangeApi* exchange_api(nb::handle obj) {
  static std::vector<std::pair<PyTypeObject*, const ExchangeApi*>> seen;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  for (const auto& [t, api] : seen)
    if (t == type) return api;
  const ExchangeApi* api = nullptr;
  if (PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__")) {
    api = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
    Py_DECREF(capsule);
    if (api && (api->version.major != 1 || !api->dltensor_from_py_object_no_sync)) api = nullptr;
  }
  PyErr_Clear();
  seen.emplace_back(type, api);
  return api;
}

// Whether a call reads an array or writes into it: a read-only array (numpy's frombuffer, a
// memory map) may go in, but not where kvforge writes.
enum class Access { read, written };

// One array argument as DLPack describes it, from the exchange table where the producer has one,
// else from __dlpack__ (nanobind's ndarray, kept referenced while the call runs).
struct ArrayArg {
  nb::dlpack::dltensor t;
  int64_t strides[4];
  Array keep;
  ReadArray keep_read;
  int64_t shape(int i) const { return t.shape[i]; }
  int64_t stride(int i) const { return strides[i]; }
  void* data() const { return static_cast<char*>(t.data) + t.byte_offset; }
  int64_t nbytes() const {
    int64_t n = (t.dtype.bits * t.dtype.lanes + 7) / 8;
    for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
    return n;
  }
  template <class A> void describe(const A& k) {
    t.data = const_cast<void*>(static_cast<const void*>(k.data()));
    t.device = {k.device_type(), k.device_id()};
    t.ndim = int32_t(k.ndim());
    t.dtype = k.dtype();
    t.shape = const_cast<int64_t*>(k.shape_ptr());
    t.strides = const_cast<int64_t*>(k.stride_ptr());
    t.byte_offset = 0;
  }
};

ArrayArg array_arg(nb::handle obj, const char* argument, Access access) {
  ArrayArg a;
  if (const ExchangeApi* api = exchange_api(obj)) {
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &a.t) != 0) {
      PyErr_Clear();
      throw ArgumentError(argument, "its producer could not describe it through DLPack");
    }
  } else if (access == Access::written && nb::try_cast(obj, a.keep, false)) {
    a.describe(a.keep);
  } else if (nb::try_cast(obj, a.keep_read, false)) {
    if (access == Access::written) throw ArgumentError(argument, "is read-only, and this call writes into it");
    a.describe(a.keep_read);
  } else {
    throw ArgumentError(argument, std::string("expected an array with __dlpack__ (a torch tensor, a numpy array...), got ") +
                                      nb::inst_name(obj).c_str());
  }
  if (a.t.ndim > 4) throw ShapeError(argument, "expected at most 4 dimensions, got " + std::to_string(a.t.ndim));
  // DLPack may leave strides out for a compact row-major array.
  int64_t step = 1;
  for (int i = a.t.ndim - 1; i >= 0; --i) {
    a.strides[i] = a.t.strides ? a.t.strides[i] : step;
    step *= a.t.shape[i];
  }
  return a;
}

// The element types DLPack arrays may carry into kvforge. fp8 has no DLPack code torch exports, and
// kvforge never takes fp8 input, so it has no entry (codes come out as uint8, see dlpack_dtype).
struct DTypeCode {
  nb::dlpack::dtype_code code;
  uint8_t bits;
  DType dtype;
  const char* dlpack_name;
};
constexpr DTypeCode kDTypeCodes[] = {
    {nb::dlpack::dtype_code::Float, 32, DType::f32, "float32"},
    {nb::dlpack::dtype_code::Float, 16, DType::f16, "float16"},
    {nb::dlpack::dtype_code::Bfloat, 16, DType::bf16, "bfloat16"},
    {nb::dlpack::dtype_code::Int, 32, DType::i32, "int32"},
    {nb::dlpack::dtype_code::Int, 64, DType::i64, "int64"},
    {nb::dlpack::dtype_code::Int, 8, DType::i8, "int8"},
};

DType dtype_of_array(const ArrayArg& a, const char* argument) {
  const nb::dlpack::dtype t = a.t.dtype;
  if (t.lanes == 1)
    for (const DTypeCode& c : kDTypeCodes)
      if (t.code == uint8_t(c.code) && t.bits == c.bits) return c.dtype;
  std::string allowed;
  for (const DTypeCode& c : kDTypeCodes) allowed += std::string(allowed.empty() ? "" : ", ") + c.dlpack_name;
  throw DtypeError(argument, "DLPack dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                                 " bits) is not one kvforge takes (allowed: " + allowed + ")");
}

Device device_of_array(const ArrayArg& a, const char* argument) {
  switch (a.t.device.device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory is host memory
      return Device::cpu;
    case nb::device::cuda::value:
      return Device::cuda;
  }
  throw DeviceError(argument, "DLPack device type " + std::to_string(a.t.device.device_type) +
                                  " is not one kvforge runs on (allowed: CPU, CUDA)");
}

TensorView tensor_view(nb::handle obj, const char* argument, Access access) {
  const ArrayArg a = array_arg(obj, argument, access);
  if (a.t.ndim != 3)
    throw ShapeError(argument, "expected 3 dimensions, got " + std::to_string(a.t.ndim) +
                                   " (append takes [tokens, heads, head_dim], gather writes [heads, tokens, head_dim])");
  TensorView t;
  t.data = a.data();
  t.dtype = dtype_of_array(a, argument);
  t.device = device_of_array(a, argument);
  for (int i = 0; i < 3; ++i) {
    t.shape[i] = a.shape(i);
    t.stride[i] = a.stride(i);
  }
  return t;  // the runtime checks shape, dtype, device and the last stride against the cache
}

IndexView index_view(nb::handle obj, const char* argument) {
  const ArrayArg a = array_arg(obj, argument, Access::read);
  if (a.t.ndim != 1) throw ShapeError(argument, "expected a 1-D index array, got " + std::to_string(a.t.ndim) + " dimensions");
  if (a.shape(0) > 1 && a.stride(0) != 1)
    throw ShapeError(argument, "must be contiguous (stride 1), got stride " + std::to_string(a.stride(0)));
  return IndexView{a.data(), dtype_of_array(a, argument), device_of_array(a, argument), a.shape(0)};
}

IndexView optional_index(nb::handle obj, const char* argument) {
  return obj.is_none() ? IndexView{} : index_view(obj, argument);
}

// Python's ints are unbounded and the runtime's layer is an int: a value past int's range lies outside
// [0, layers) too, and is refused as the runtime refuses any other, not as a mismatched signature.
// The variants this module was built with, then those of every library loaded since (load_variants,
// kvforge.variant()). Each load makes a new merged registry; the earlier ones stay, because descriptors
// and entries handed out point into them. The GIL orders the loads.
std::deque<Registry>& known_registries() {
  static std::deque<Registry> all{Registry(registry().variants())};
  return all;
}
const Registry& known() { return known_registries().back(); }

int layer_arg(const Cache& cache, int64_t layer) {
  if (layer < INT_MIN || layer > INT_MAX) throw OutOfRangeError("layer", layer, 0, cache.descriptor().layers);
  return int(layer);
}

// ---- DLPack out ----

nb::dlpack::dtype dlpack_dtype(DType t) {
  switch (t) {
    case DType::f32: return nb::dtype<float>();
    case DType::f16: return {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::bf16: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::i32: return nb::dtype<int32_t>();
    case DType::i64: return nb::dtype<int64_t>();
    case DType::i8: return nb::dtype<int8_t>();
    case DType::f8e4m3:
    case DType::f8e5m2: return nb::dtype<uint8_t>();  // as SGLang stores fp8: bytes, viewed back on read
  }
  return nb::dtype<uint8_t>();
}

int dlpack_device(Device d) { return d == Device::cuda ? nb::device::cuda::value : nb::device::cpu::value; }

// A view of memory `owner` holds; the exported array keeps `owner` (the Python cache) alive.
Exported export_array(const void* data, DType dtype, Device device, std::vector<size_t> shape,
                      std::vector<int64_t> strides, nb::handle owner) {
  return Exported(const_cast<void*>(data), shape.size(), shape.data(), owner, strides.data(), dlpack_dtype(dtype),
                  dlpack_device(device));
}

// A host array that owns a copy of `values`.
template <class T> nb::ndarray<nb::numpy, T> owned_array(std::vector<T> values, std::vector<size_t> shape) {
  auto* held = new std::vector<T>(std::move(values));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(held->data(), shape.size(), shape.data(), owner);
}
template <class T> nb::ndarray<nb::numpy, T> owned_array(std::vector<T> values) {
  const size_t n = values.size();
  return owned_array(std::move(values), {n});
}

// ---- names <-> enums ----

template <class E, size_t N> E enum_from(const std::string& text, const char* const (&names)[N], const char* argument) {
  for (size_t i = 0; i < N; ++i)
    if (text == names[i]) return E(i);
  std::string allowed;
  for (size_t i = 0; i < N; ++i) allowed += std::string(i ? ", " : "") + names[i];
  throw ArgumentError(argument, "'" + text + "' is not one of " + allowed);
}

Device device_named(const std::string& name) { return enum_from<Device>(name, kDeviceNames, "device"); }

std::optional<DType> dtype_named(const std::optional<std::string>& name, const char* argument) {
  if (!name) return std::nullopt;
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::i8, DType::f8e4m3, DType::f8e5m2})
    if (*name == dtype_name(t)) return t;
  throw ArgumentError(argument, "'" + *name + "' is not a storage or input dtype (allowed: fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2)");
}

std::string name(DType t) { return std::string(dtype_name(t)); }

// ---- errors ----

// Raises the class of kvforge/errors.py named `class_name`, with the C++ message and these fields.
void raise_python(const char* class_name, const std::exception& e, nb::dict fields = {}) {
  nb::object errors = nb::module_::import_("kvforge.errors");
  nb::object cls = errors.attr(class_name);
  nb::object instance = cls(e.what());
  for (auto [key, value] : fields) nb::setattr(instance, key, value);
  PyErr_SetObject(cls.ptr(), instance.ptr());
}

// The Python class of an argument error: its most derived kvforge class.
const char* argument_class(const ArgumentError& e) {
  if (dynamic_cast<const ShapeError*>(&e)) return "ShapeError";
  if (dynamic_cast<const DtypeError*>(&e)) return "DtypeError";
  if (dynamic_cast<const DeviceError*>(&e)) return "DeviceError";
  if (dynamic_cast<const StateError*>(&e)) return "StateError";
  return "ArgumentError";
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const OutOfRangeError& e) {
    nb::dict f;
    f["argument"] = e.argument(), f["value"] = e.value(), f["lo"] = e.lo(), f["hi"] = e.hi(), f["index"] = e.index();
    raise_python("OutOfRangeError", e, f);
  } catch (const CapacityError& e) {
    nb::dict f;
    f["argument"] = e.argument(), f["needed"] = e.needed(), f["available"] = e.available();
    raise_python("CapacityError", e, f);
  } catch (const ArgumentError& e) {
    nb::dict f;
    f["argument"] = e.argument();
    raise_python(argument_class(e), e, f);
  } catch (const UnknownVariantError& e) {
    nb::dict f;
    f["name"] = e.name(), f["nearest"] = e.nearest();
    raise_python("UnknownVariantError", e, f);
  } catch (const UnsupportedError& e) {
    raise_python("UnsupportedError", e);
  } catch (const BackendError& e) {
    raise_python("BackendError", e);
  }
}

// ---- cache views ----

nb::dict layer_view(const Cache& cache, int layer, nb::handle owner) {
  const LayerView v = cache.view(layer);
  const std::vector<size_t> shape{size_t(v.rows_or_pages), size_t(v.seq_or_slots), size_t(v.heads), size_t(v.head_dim)};
  const std::vector<int64_t> strides{v.strides.row_or_page, v.strides.seq_or_slot, v.strides.head, 1};
  nb::dict out;
  out["k"] = export_array(v.k, v.dtype, v.device, shape, strides, owner);
  out["v"] = export_array(v.v, v.dtype, v.device, shape, strides, owner);
  out["dtype"] = name(v.dtype);
  out["quant"] = name_of(v.quant);
  if (v.quant != Quant::none) {
    const std::vector<size_t> scale_shape{shape[0], shape[1], shape[2]};
    const std::vector<int64_t> scale_strides{v.scale_strides.row_or_page, v.scale_strides.seq_or_slot,
                                             v.scale_strides.head};
    out["k_scales"] = export_array(v.k_scales, v.scale_dtype, v.device, scale_shape, scale_strides, owner);
    out["v_scales"] = export_array(v.v_scales, v.scale_dtype, v.device, scale_shape, scale_strides, owner);
  }
  return out;
}

// The cache's own allocations as flat bytes: the pool, then the separate scale buffer if there is one
// (in-page scales are inside the pool). A hybrid cache lists each group's in turn.
void raw_buffers(const Cache& cache, nb::handle owner, nb::list& out) {
  if (cache.num_groups() > 1) {
    for (int g = 0; g < cache.num_groups(); ++g) raw_buffers(const_cast<Cache&>(cache).group(g), owner, out);
    return;
  }
  const MemoryReport m = cache.memory();
  const bool separate_scales = cache.scale_storage() != nullptr;
  const int64_t pool = m.storage_bytes - (separate_scales ? m.scale_bytes : 0);
  out.append(export_array(cache.storage(), DType::i8, cache.config().device, {size_t(pool)}, {1}, owner));
  if (separate_scales)
    out.append(export_array(cache.scale_storage(), DType::i8, cache.config().device, {size_t(m.scale_bytes)}, {1}, owner));
}

nb::list layer_groups(const VariantDescriptor& d) {
  nb::list groups;
  if (d.hybrid)
    for (int g = 0; g < d.hybrid->num_groups; ++g) {
      const LayerGroupInfo& info = d.hybrid->groups[g];
      nb::dict gi;
      gi["name"] = info.name;
      gi["layers"] = std::vector<int>(info.layers, info.layers + info.num_layers);
      gi["sliding_window"] = info.sliding_window;
      gi["member"] = info.member->name;
      gi["member_layout"] = info.member->layout;
      gi["page_size"] = info.member->page_size;
      groups.append(gi);
    }
  return groups;
}

nb::dict tuning_fields(const Tuning& t) {
  nb::dict f;
  f["cpu_parallel_bytes"] = t.cpu_parallel_bytes, f["cpu_chunk_items"] = t.cpu_chunk_items,
  f["cuda_block_threads"] = t.cuda_block_threads, f["cuda_items_per_thread"] = t.cuda_items_per_thread;
  return f;
}

nb::dict batch_arrays(BatchMetadata m) {
  nb::dict b;
  const size_t sequences = m.lengths.size();
  b["max_pages"] = m.max_pages;
  b["slots"] = owned_array(std::move(m.slots));
  b["query_start"] = owned_array(std::move(m.query_start));
  b["lengths"] = owned_array(std::move(m.lengths));
  b["page_table"] = owned_array(std::move(m.page_table), {sequences, size_t(m.max_pages)});
  b["indptr"] = owned_array(std::move(m.indptr));
  b["indices"] = owned_array(std::move(m.indices));
  b["last_page_len"] = owned_array(std::move(m.last_page_len));
  return b;
}

nb::dict gather_range(const GatherRange& r) {
  nb::dict out;
  out["begin"] = r.begin, out["end"] = r.end;
  // The manager's page list lives in scratch that its next call reuses: hand Python its own copy.
  std::vector<int32_t> pages(size_t(r.pages.size));
  if (!pages.empty()) {
    if (r.pages.device == Device::cpu)
      std::memcpy(pages.data(), r.pages.data, pages.size() * sizeof(int32_t));
    else
      backend(r.pages.device).to_host(pages.data(), r.pages.data, pages.size() * sizeof(int32_t), nullptr);
  }
  out["pages"] = owned_array(std::move(pages));
  return out;
}

SequenceManagerOptions manager_options(bool prefix_caching, uint64_t salt, int32_t host_blocks, int32_t window) {
  SequenceManagerOptions o;
  o.prefix_caching = prefix_caching, o.salt = salt, o.host_blocks = host_blocks, o.window = window;
  return o;
}

// The runtime trusts a raw pointer for the packed pages; from Python the buffer's size is checked too.
void* packed_bytes(const Cache& cache, const IndexView& pages, nb::handle obj, Access access) {
  const ArrayArg packed = array_arg(obj, "packed", access);
  if (packed.t.ndim != 1 || (packed.shape(0) > 1 && packed.stride(0) != 1))
    throw ShapeError("packed", "must be a contiguous 1-D byte array");
  const int64_t need = pages.size * cache.packed_page_bytes();
  if (packed.nbytes() < need)
    throw ShapeError("packed", "holds " + std::to_string(packed.nbytes()) + " bytes; " + std::to_string(pages.size) +
                                   " pages need " + std::to_string(need) + " (packed_page_bytes() each)");
  if (device_of_array(packed, "packed") != cache.config().device)
    throw DeviceError("packed", std::string("must be on the cache's device (") + name_of(cache.config().device) + ")");
  return packed.data();
}

using Release = nb::call_guard<nb::gil_scoped_release>;

}  // namespace
}  // namespace kvforge

NB_MODULE(_native, m) {
  using namespace kvforge;
  m.doc() = "kvforge's runtime over DLPack (see kvforge/__init__.py for the Python API)";
  nb::register_exception_translator(translate);
  // Descriptors are references to static data, often still held by module globals at exit, which
  // nanobind would report as leaks.
  nb::set_leak_warnings(false);

  m.def("variants", [](std::optional<std::string> layout, std::optional<std::string> model,
                       std::optional<std::string> storage, std::optional<std::string> input) {
    VariantQuery q{layout.value_or(""), model.value_or(""), dtype_named(storage, "storage"), dtype_named(input, "input")};
    std::vector<std::string> names;
    for (const VariantEntry* e : known().select(q)) names.push_back(e->descriptor->name);
    return names;
  }, "layout"_a = nb::none(), "model"_a = nb::none(), "storage"_a = nb::none(), "input"_a = nb::none());
  m.def("describe", [](const std::string& name) -> const VariantDescriptor& { return *known().at(name).descriptor; },
        "name"_a, nb::rv_policy::reference);
  m.def("nearest", [](const std::string& name) { return known().nearest(name); }, "name"_a);
  m.def("load_variants", [](const std::string& path, const std::string& registry_function) {
    const Registry& loaded = load_variants(path, registry_function);
    known_registries().push_back(merged(known(), loaded));
    std::vector<std::string> names;
    for (const VariantEntry& e : loaded.variants()) names.push_back(e.descriptor->name);
    return names;
  }, "path"_a, "registry_function"_a = "kvforge::registry",
     "Loads a shared library of generated variants; returns their names. See docs/on_demand.md.");
  m.def("variant_name", [](const std::string& layout, const std::string& model, const std::string& storage,
                           const std::string& input) {
    return variant_name(layout, model, *dtype_named(storage, "storage"), *dtype_named(input, "input"));
  });

  nb::class_<VariantDescriptor>(m, "Descriptor")
      .def_prop_ro("name", [](const VariantDescriptor& d) { return d.name; })
      .def_prop_ro("layout", [](const VariantDescriptor& d) { return d.layout; })
      .def_prop_ro("model", [](const VariantDescriptor& d) { return d.model; })
      .def_prop_ro("storage", [](const VariantDescriptor& d) { return name(d.storage); })
      .def_prop_ro("input", [](const VariantDescriptor& d) { return name(d.input); })
      .def_prop_ro("addressing", [](const VariantDescriptor& d) { return name_of(d.addressing); })
      .def_prop_ro("update", [](const VariantDescriptor& d) { return name_of(d.update); })
      .def_ro("layers", &VariantDescriptor::layers)
      .def_ro("heads", &VariantDescriptor::heads)
      .def_ro("head_dim", &VariantDescriptor::head_dim)
      .def_ro("page_size", &VariantDescriptor::page_size)
      .def_ro("window", &VariantDescriptor::window)
      .def_ro("max_seq_len", &VariantDescriptor::max_seq_len)
      .def_prop_ro("axes", [](const VariantDescriptor& d) {
        std::vector<std::string> axes;
        for (int i = 0; i < d.num_axes; ++i) axes.push_back(name_of(d.axes[i]));
        return axes;
      })
      .def_ro("bytes_per_token", &VariantDescriptor::bytes_per_token)
      .def_ro("tensor_parallel", &VariantDescriptor::tensor_parallel)
      .def_ro("model_heads", &VariantDescriptor::model_heads)
      .def_prop_ro("shard_of", [](const VariantDescriptor& d) { return d.shard_of ? d.shard_of : d.model; })
      .def("shard_heads", [](const VariantDescriptor& d, int rank) {
        const HeadRange r = shard_heads(d, rank);
        return std::make_pair(r.begin, r.end());
      }, "rank"_a, "The heads [begin, end) of the whole model that tensor-parallel `rank` holds.")
      .def_prop_ro("quant", [](const VariantDescriptor& d) { return name_of(d.quant); })
      .def_prop_ro("scale_dtype", [](const VariantDescriptor& d) {
        return d.quantized() ? std::optional<std::string>(name(d.scale)) : std::nullopt;
      })
      .def_prop_ro("scale_placement", [](const VariantDescriptor& d) {
        return d.quantized() ? std::optional<std::string>(name_of(d.scale_placement)) : std::nullopt;
      })
      .def_prop_ro("groups", &layer_groups)
      .def_ro("generic", &VariantDescriptor::generic)
      .def_prop_ro("paged", &VariantDescriptor::paged)
      .def_prop_ro("stacked", &VariantDescriptor::stacked)
      .def_prop_ro("kv_fused", &VariantDescriptor::kv_fused)
      .def_prop_ro("quantized", &VariantDescriptor::quantized)
      .def_prop_ro("lazy", &VariantDescriptor::lazy)
      .def_prop_ro("hybrid", &VariantDescriptor::is_hybrid)
      .def_prop_ro("tuning", [](const VariantDescriptor& d) { return tuning_fields(d.tuning); })
      .def("__repr__", [](const VariantDescriptor& d) { return std::string("<kvforge.Descriptor ") + d.name + ">"; });

  nb::class_<Cache>(m, "Cache")
      .def_prop_ro("descriptor", [](const Cache& c) -> const VariantDescriptor& { return c.descriptor(); },
                   nb::rv_policy::reference_internal)
      .def_prop_ro("config", [](const Cache& c) {
        const CacheConfig& k = c.config();
        nb::dict f;
        f["device"] = name_of(k.device), f["rows"] = k.rows, f["max_seq_len"] = k.max_seq_len, f["pages"] = k.pages,
        f["max_staged_tokens"] = k.max_staged_tokens, f["stream"] = uintptr_t(k.stream);
        return f;
      })
      .def("append", [](Cache& c, int64_t layer, nb::handle k, nb::handle v, nb::handle rows, nb::handle positions,
                        nb::handle slots) {
        TokenTargets t{optional_index(rows, "targets.rows"), optional_index(positions, "targets.positions"),
                       optional_index(slots, "targets.slots")};
        const TensorView kv = tensor_view(k, "k", Access::read), vv = tensor_view(v, "v", Access::read);
        nb::gil_scoped_release unlocked;
        c.append(layer_arg(c, layer), kv, vv, t);
      }, "layer"_a, "k"_a.none(), "v"_a.none(), "rows"_a = nb::none(), "positions"_a = nb::none(), "slots"_a = nb::none())
      .def("commit", &Cache::commit, Release())
      .def("gather", [](Cache& c, int64_t layer, nb::handle k_out, nb::handle v_out, int64_t row, nb::handle pages,
                        int64_t begin, int64_t end) {
        GatherRange r{row, optional_index(pages, "range.pages"), begin, end};
        const TensorView ko = tensor_view(k_out, "k_out", Access::written), vo = tensor_view(v_out, "v_out", Access::written);
        nb::gil_scoped_release unlocked;
        c.gather(layer_arg(c, layer), r, ko, vo);
      }, "layer"_a, "k_out"_a.none(), "v_out"_a.none(), "row"_a = 0, "pages"_a = nb::none(), "begin"_a = 0, "end"_a)
      .def("reset", &Cache::reset, Release())
      .def("reset_row", &Cache::reset_row, "row"_a, Release())
      .def("reorder", [](Cache& c, nb::handle beam) {
        const IndexView b = index_view(beam, "beam");
        nb::gil_scoped_release unlocked;
        c.reorder(b);
      }, "beam"_a)
      .def("copy_blocks", [](Cache& c, nb::handle pairs) {
        const IndexView p = index_view(pairs, "pairs");
        nb::gil_scoped_release unlocked;
        c.copy_blocks(p);
      }, "pairs"_a)
      .def("view", [](nb::handle self, int64_t layer) {
        const Cache& c = nb::cast<const Cache&>(self);
        return layer_view(c, layer_arg(c, layer), self);
      },
           "layer"_a)
      .def("buffers", [](nb::handle self) {
        nb::list out;
        raw_buffers(nb::cast<const Cache&>(self), self, out);
        return out;
      })
      .def("packed_page_bytes", &Cache::packed_page_bytes)
      .def("pack_pages", [](Cache& c, nb::handle pages, nb::handle packed) {
        const IndexView p = index_view(pages, "pages");
        void* out = packed_bytes(c, p, packed, Access::written);
        nb::gil_scoped_release unlocked;
        c.pack_pages(p, out);
      }, "pages"_a.none(), "packed"_a.none())
      .def("unpack_pages", [](Cache& c, nb::handle packed, nb::handle pages) {
        const IndexView p = index_view(pages, "pages");
        const void* in = packed_bytes(c, p, packed, Access::read);
        nb::gil_scoped_release unlocked;
        c.unpack_pages(in, p);
      }, "packed"_a.none(), "pages"_a.none())
      .def("set_tensor_scale", [](Cache& c, int64_t layer, float k_scale, float v_scale) {
        const int l = layer_arg(c, layer);
        nb::gil_scoped_release unlocked;
        c.set_tensor_scale(l, k_scale, v_scale);
      }, "layer"_a, "k_scale"_a, "v_scale"_a)
      .def("row_length", &Cache::row_length, "row"_a, Release())
      .def("synchronize", &Cache::synchronize, Release())
      .def("memory", [](const Cache& c) {
        const MemoryReport r = c.memory();
        nb::dict f;
        f["storage_bytes"] = r.storage_bytes, f["scale_bytes"] = r.scale_bytes, f["staging_bytes"] = r.staging_bytes,
        f["bookkeeping_bytes"] = r.bookkeeping_bytes, f["overhead_bytes"] = r.overhead_bytes();
        return f;
      })
      // The CUDA stream later operations are queued on, as an integer handle (torch: stream.cuda_stream).
      .def("set_stream", [](Cache& c, uintptr_t stream) { c.set_stream(reinterpret_cast<void*>(stream)); }, "stream"_a)
      .def_prop_ro("tuning", [](const Cache& c) { return tuning_fields(c.tuning()); })
      .def("set_tuning", [](Cache& c, std::optional<int64_t> cpu_parallel_bytes, std::optional<int> cpu_chunk_items,
                            std::optional<int> cuda_block_threads, std::optional<int> cuda_items_per_thread) {
        Tuning t = c.tuning();
        if (cpu_parallel_bytes) t.cpu_parallel_bytes = *cpu_parallel_bytes;
        if (cpu_chunk_items) t.cpu_chunk_items = *cpu_chunk_items;
        if (cuda_block_threads) t.cuda_block_threads = *cuda_block_threads;
        if (cuda_items_per_thread) t.cuda_items_per_thread = *cuda_items_per_thread;
        c.set_tuning(t);
      }, "cpu_parallel_bytes"_a = nb::none(), "cpu_chunk_items"_a = nb::none(), "cuda_block_threads"_a = nb::none(),
         "cuda_items_per_thread"_a = nb::none())
      .def_prop_ro("num_groups", &Cache::num_groups)
      .def("group", [](Cache& c, int g) -> Cache& { return c.group(g); }, "g"_a, nb::rv_policy::reference_internal)
      .def("group_of", &Cache::group_of, "layer"_a)
      .def("group_layer", &Cache::group_layer, "layer"_a);

  m.def("create", [](const std::optional<std::string>& name, const std::optional<std::string>& layout,
                     const std::optional<std::string>& model, const std::optional<std::string>& storage,
                     const std::optional<std::string>& input, const std::string& device, int64_t rows,
                     int64_t max_seq_len, int64_t pages, int64_t max_staged_tokens, uintptr_t stream) {
    CacheConfig config;
    config.device = device_named(device);
    config.rows = rows, config.max_seq_len = max_seq_len, config.pages = pages;
    config.max_staged_tokens = max_staged_tokens, config.stream = reinterpret_cast<void*>(stream);
    if (name) {
      if (layout || model || storage || input)
        throw ArgumentError("name", "give a variant name or a query (layout, model, storage, input), not both");
      return known().create(*name, config);
    }
    VariantQuery q{layout.value_or(""), model.value_or(""), dtype_named(storage, "storage"), dtype_named(input, "input")};
    return known().create(q, config);
  }, "name"_a = nb::none(), "layout"_a = nb::none(), "model"_a = nb::none(), "storage"_a = nb::none(),
     "input"_a = nb::none(), "device"_a = "cpu", "rows"_a = 1, "max_seq_len"_a = 0, "pages"_a = 0,
     "max_staged_tokens"_a = 0, "stream"_a = 0);

  m.def("plan_memory", [](const std::string& name, const std::string& mode, const std::string& device, int64_t pages,
                          int64_t reserve_bytes, int64_t budget_bytes) {
    static const char* const kModes[] = {"allocate", "reserve"};
    MemoryRequest r;
    r.mode = enum_from<PlanMode>(mode, kModes, "mode");
    r.device = device_named(device);
    r.pages = pages, r.reserve_bytes = reserve_bytes, r.budget_bytes = budget_bytes;
    const MemoryPlan p = plan_memory(*known().at(name).descriptor, r);
    nb::dict f;
    f["pages"] = p.pages, f["page_bytes"] = p.page_bytes, f["pool_bytes"] = p.pool_bytes, f["tokens"] = p.tokens,
    f["page_size"] = p.page_size;
    return f;
  }, "name"_a, "mode"_a = "allocate", "device"_a = "cpu", "pages"_a = 0, "reserve_bytes"_a = 0, "budget_bytes"_a = 0);

  nb::class_<SequenceManager>(m, "SequenceManager")
      .def("__init__", [](SequenceManager* self, Cache& cache, bool prefix_caching, uint64_t salt, int32_t host_blocks,
                          int32_t window) {
        new (self) SequenceManager(cache, manager_options(prefix_caching, salt, host_blocks, window));
      }, "cache"_a, "prefix_caching"_a = true, "salt"_a = 0, "host_blocks"_a = 0, "window"_a = 0,
         nb::keep_alive<1, 2>())
      .def("add", [](SequenceManager& s, int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
        return s.add(seq, prompt, salt);
      }, "seq"_a, "prompt"_a, "salt"_a = nb::none())
      .def("cached_prefix", [](const SequenceManager& s, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
        return s.cached_prefix(prompt, salt);
      }, "prompt"_a, "salt"_a = nb::none())
      .def("append", &SequenceManager::append, "seq"_a, "tokens"_a)
      .def("fork", &SequenceManager::fork, "parent"_a, "child"_a)
      .def("free", &SequenceManager::free, "seq"_a)
      .def("offload", &SequenceManager::offload, "seq"_a, Release())
      .def("restore", &SequenceManager::restore, "seq"_a, Release())
      .def("step", [](SequenceManager& s, const std::vector<int64_t>& seqs) { return batch_arrays(s.step(seqs)); },
           "seqs"_a)
      .def("step_on_device", [](nb::handle self, const std::vector<int64_t>& seqs, bool indices) {
        const DeviceStep& d = nb::cast<SequenceManager&>(self).step_on_device(seqs, indices);
        // Views of the manager's persistent device state (kept alive by them), valid until its next step.
        nb::dict out;
        auto put = [&](const char* key, const IndexView& v) {
          out[key] = export_array(v.data, v.dtype, v.device, {size_t(v.size)}, {1}, self);
        };
        put("slots", d.slots), put("query_start", d.query_start), put("seq_lens", d.seq_lens), put("rows", d.rows);
        put("indptr", d.indptr), put("last_page_len", d.last_page_len);
        if (indices) put("indices", d.indices);
        const size_t stride = size_t(d.block_table_stride);
        out["block_table"] = export_array(d.block_table.data, DType::i32, d.block_table.device,
                                          {size_t(d.block_table.size) / stride, stride}, {int64_t(stride), 1}, self);
        out["uploaded_bytes"] = d.uploaded_bytes;
        return out;
      }, "seqs"_a, "indices"_a = false)
      .def("range", [](SequenceManager& s, int64_t seq, int64_t begin, int64_t end) {
        return gather_range(s.range(seq, begin, end));
      }, "seq"_a, "begin"_a, "end"_a)
      .def("__contains__", &SequenceManager::contains, "seq"_a)
      .def("length", &SequenceManager::length, "seq"_a)
      .def("offloaded", &SequenceManager::offloaded, "seq"_a)
      .def("pages", [](const SequenceManager& s, int64_t seq) { return s.pages(seq); }, "seq"_a)
      .def("tokens", [](const SequenceManager& s, int64_t seq) { return s.tokens(seq); }, "seq"_a)
      .def_prop_ro("stats", [](const SequenceManager& s) {
        const SequenceStats& t = s.stats();
        nb::dict f;
        f["prefix_hits"] = t.prefix_hits, f["prefix_misses"] = t.prefix_misses, f["evictions"] = t.evictions,
        f["copies_on_write"] = t.copies_on_write, f["offloaded_pages"] = t.offloaded_pages,
        f["restored_pages"] = t.restored_pages;
        return f;
      })
      .def_prop_ro("available_blocks", &SequenceManager::available_blocks)
      .def_prop_ro("cached_blocks", &SequenceManager::cached_blocks)
      .def_prop_ro("host_free", &SequenceManager::host_free)
      .def("utilization", &SequenceManager::utilization)
      .def("check_invariants", &SequenceManager::check_invariants);

  nb::class_<HybridSequenceManager>(m, "HybridSequenceManager")
      .def("__init__", [](HybridSequenceManager* self, Cache& cache, bool prefix_caching, uint64_t salt) {
        new (self) HybridSequenceManager(cache, manager_options(prefix_caching, salt, 0, 0));
      }, "cache"_a, "prefix_caching"_a = true, "salt"_a = 0, nb::keep_alive<1, 2>())
      .def("add", [](HybridSequenceManager& s, int64_t seq, const std::vector<int32_t>& prompt,
                     std::optional<uint64_t> salt) { return s.add(seq, prompt, salt); },
           "seq"_a, "prompt"_a, "salt"_a = nb::none())
      .def("append", &HybridSequenceManager::append, "seq"_a, "tokens"_a)
      .def("fork", &HybridSequenceManager::fork, "parent"_a, "child"_a)
      .def("free", &HybridSequenceManager::free, "seq"_a)
      .def("step", [](HybridSequenceManager& s, const std::vector<int64_t>& seqs) {
        nb::list out;
        for (BatchMetadata& b : s.step(seqs)) out.append(batch_arrays(std::move(b)));
        return out;
      }, "seqs"_a)
      .def("range", [](HybridSequenceManager& s, int layer, int64_t seq, int64_t begin, int64_t end) {
        return gather_range(s.range(layer, seq, begin, end));
      }, "layer"_a, "seq"_a, "begin"_a, "end"_a)
      .def("length", &HybridSequenceManager::length, "seq"_a)
      .def_prop_ro("num_groups", &HybridSequenceManager::num_groups)
      .def("group", &HybridSequenceManager::group, "g"_a, nb::rv_policy::reference_internal);

  m.def("quant_max", [](const std::string& storage) -> float {
    switch (*dtype_named(storage, "storage")) {
      case DType::i8: return detail::Codec<int8_t>::qmax;
      case DType::f8e4m3: return detail::Codec<fp8_e4m3>::qmax;
      case DType::f8e5m2: return detail::Codec<fp8_e5m2>::qmax;
      default: throw ArgumentError("storage", "'" + storage + "' is not quantized (allowed: int8, fp8_e4m3, fp8_e5m2)");
    }
  }, "storage"_a, "The largest code magnitude of a quantized storage dtype (docs/quantization.md)");
  // For bench/python_overhead.py: the same append as Cache.append, repeated from C++ with the
  // arguments converted once, so that the Python boundary's cost per call can be measured beside it.
  m.def("_append_loop_seconds", [](Cache& c, int layer, nb::handle k, nb::handle v, nb::handle slots, int iterations) {
    if (iterations < 1) throw OutOfRangeError("iterations", iterations, 1, INT32_MAX);
    const TensorView kv = tensor_view(k, "k", Access::read), vv = tensor_view(v, "v", Access::read);
    const TokenTargets t = TokenTargets::paged(index_view(slots, "targets.slots"));
    nb::gil_scoped_release unlocked;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) c.append(layer, kv, vv, t);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
  }, "cache"_a, "layer"_a, "k"_a, "v"_a, "slots"_a, "iterations"_a);
  m.def("shard_pieces", [](int model_heads, int sender_tp, int receiver_tp) {
    nb::list out;
    for (const ShardPiece& p : shard_pieces(model_heads, sender_tp, receiver_tp))
      out.append(nb::make_tuple(p.sender, p.receiver, p.heads.begin, p.heads.end()));
    return out;
  }, "model_heads"_a, "sender_tp"_a, "receiver_tp"_a,
        "[(sender, receiver, head_begin, head_end)]: which sender rank gives each receiver rank which heads.");
  m.def("cpu_level", [] { return cpu_level(); });
  m.def("set_cpu_threads", [](int64_t threads) {
    if (threads < 0 || threads > INT32_MAX) throw OutOfRangeError("threads", threads, 0, INT32_MAX, -1, "0 is OpenMP's own count");
    set_cpu_threads(int(threads));
  }, "threads"_a, "Bounds the threads one CPU operation uses (0: OpenMP's own count); see docs/python.md.");
  m.def("cpu_threads", [] { return cpu_threads(); }, "The bound in force, resolved: at least 1.");
  m.def("cuda_available", [] { return cuda_available(); });
}
