// The translations of kvforge._native (bindings.cpp), which includes this header once: DLPack arrays in
// and out as the runtime's views, names as its enums, its typed errors as the Python classes of
// kvforge/errors.py, and its results (step arrays, ranges) as Python values; views.hpp exports the
// cache's memory. Internal linkage: one translation unit uses it.
#pragma once

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

// The backend table (vocab.hpp) says which DLPack device types each device's memory is.
Device device_of_array(const ArrayArg& a, const char* argument) {
  std::string allowed;
  for (size_t d = 0; d < std::size(kBackendDLPackDevices); ++d)
    for (const int type : kBackendDLPackDevices[d]) {
      if (type == 0) break;
      if (int(a.t.device.device_type) == type) return Device(d);
      allowed += (allowed.empty() ? "" : ", ") + std::to_string(type) + " (" + kDeviceNames[d] + ")";
    }
  throw DeviceError(argument, "DLPack device type " + std::to_string(a.t.device.device_type) +
                                  " is not one kvforge runs on (allowed: " + allowed + ")");
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
    case DType::ue8m0: return nb::dtype<uint8_t>();   // the exponent byte; torch views it as float8_e8m0fnu
    case DType::f4e2m1:                               // two codes a byte; torch views it as float4_e2m1fn_x2
    case DType::i4:
    case DType::u4:
    case DType::record: return nb::dtype<uint8_t>();  // a record's bytes
    case DType::bf16_zero: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};  // views add [.., 2]
    case DType::f32_zero: return nb::dtype<float>();
  }
  return nb::dtype<uint8_t>();
}

int dlpack_device(Device d) { return kBackendDLPackDevices[size_t(d)][0]; }

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
  constexpr DType kNamed[] = {DType::f32,    DType::f16,    DType::bf16, DType::i8,
                              DType::f8e4m3, DType::f8e5m2, DType::f4e2m1, DType::i4, DType::u4};
  std::string allowed;
  for (DType t : kNamed) {
    if (*name == dtype_name(t)) return t;
    allowed += std::string(allowed.empty() ? "" : ", ") + std::string(dtype_name(t));
  }
  throw ArgumentError(argument, "'" + *name + "' is not a storage or input dtype (allowed: " + allowed + ")");
}

std::string name(DType t) { return std::string(dtype_name(t)); }

// A query from Python's names. A storage is a dtype's name, or a record format's (flashmla_fp8, or any
// a layout spec defines) that a known variant stores.
VariantQuery query_of(const std::optional<std::string>& layout, const std::optional<std::string>& model,
                      const std::optional<std::string>& storage, const std::optional<std::string>& input) {
  VariantQuery q{layout.value_or(""), model.value_or(""), std::nullopt, dtype_named(input, "input"), ""};
  if (!storage) return q;
  for (const VariantEntry& e : known().variants())
    if (e.descriptor->record_format && *storage == e.descriptor->record_format->name) {
      q.storage = DType::record, q.record = *storage;
      return q;
    }
  q.storage = dtype_named(storage, "storage");
  return q;
}

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

// `base` with the fields `given` names (Cache.set_tuning's keywords), each an int; any other name
// is refused, naming the ones there are.
Tuning tuning_from(Tuning base, const nb::kwargs& given) {
  for (auto [key, value] : given) {
    const std::string name = nb::cast<std::string>(key);
    bool known = false;
    std::string names;
    for_each_tunable(base, [&](const char* field, int64_t& slot, const tunables::Range&) {
      names += std::string(names.empty() ? "" : ", ") + field;
      if (name != field) return;
      known = true;
      if (!nb::isinstance<nb::int_>(value) || nb::isinstance<nb::bool_>(value))
        throw ArgumentError(name, "expected an int, got " + nb::cast<std::string>(nb::str(value.type().attr("__name__"))));
      slot = nb::cast<int64_t>(value);
    });
    if (!known) throw ArgumentError(name, "not a launch parameter (allowed: " + names + ")");
  }
  return base;
}

nb::dict tuning_fields(const Tuning& t) {
  nb::dict f;
  for_each_tunable(t, [&](const char* name, int64_t value, const tunables::Range&) { f[name] = value; });
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

SequenceManagerOptions manager_options(bool prefix_caching, uint64_t salt, int32_t host_blocks, int32_t window,
                                       const std::string& block_hash, const std::string& hash_seed) {
  SequenceManagerOptions o;
  o.prefix_caching = prefix_caching, o.salt = salt, o.host_blocks = host_blocks, o.window = window;
  if (block_hash == "vllm_sha256_cbor") o.block_hash = BlockHashScheme::vllm_sha256_cbor;
  else if (block_hash != "kvforge")
    throw ArgumentError("block_hash", "'" + block_hash + "' is not a block hash (allowed: kvforge, vllm_sha256_cbor)");
  o.hash_seed = hash_seed;
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
