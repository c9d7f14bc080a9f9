// kvforge.Cache's operations, bound from the rows of runtime/include/kvforge/cache_ops.hpp: bindings.cpp
// expands the table into one bind_row call a row, and the row's C++ signature picks its binding here.
// Each overload below is one family of signatures and says once how its C++ parameters appear in
// Python: a TokenTargets as rows, positions and slots; a GatherRange as row, pages, begin and end after
// the output tensors; a layer through layer_arg; index arrays and tensors by the row's own argument
// names (so errors name them). A new row of a signature already here needs no binding code; a new
// signature fails to compile until a family says how to bind it. Each family returns its name, which
// kvforge._cache_ops reports with the row's arguments: kvforge/ops.py makes the torch ops from them.
// Internal linkage, as translate.hpp's.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "translate.hpp"
#include "views.hpp"

namespace kvforge {
namespace {

// How a row appears in Python (its `python` column).
enum class PythonForm { method, torch, property, none };

// A name made at binding time, kept for the module's life: nanobind and the errors hold the pointer.
// Only binding and kvforge._cache_ops make names, once for each distinct one; calls reuse them.
const char* kept_name(std::string name) {
  static std::set<std::string> kept;  // a set's elements stay where they are
  return kept.insert(std::move(name)).first->c_str();
}

// A row's argument names, from its stringized list "(layer, k, v, targets)".
std::vector<const char*> row_arguments(const char* list) {
  std::vector<const char*> names;
  std::string name;
  for (const char* c = list; *c; ++c) {
    if (*c == '(' || *c == ' ') continue;
    if (*c == ',' || *c == ')') {
      if (!name.empty()) names.push_back(kept_name(std::move(name)));
      name.clear();
    } else {
      name += *c;
    }
  }
  return names;
}

// "targets" -> "targets.rows": a struct's field as the runtime's errors name it.
const char* field_of(const char* parent, const char* field) { return kept_name(std::string(parent) + "." + field); }

// A TokenTargets' three arrays, named as its fields.
struct TargetNames {
  const char *rows, *positions, *slots;
  explicit TargetNames(const char* parent)
      : rows(field_of(parent, "rows")), positions(field_of(parent, "positions")), slots(field_of(parent, "slots")) {}
  TokenTargets from(nb::handle r, nb::handle p, nb::handle s) const {
    return TokenTargets{optional_index(r, rows), optional_index(p, positions), optional_index(s, slots)};
  }
};

using CacheClass = nb::class_<Cache>;
using Names = std::vector<const char*>;

// A Python value for each result type a row returns.
nb::object to_python(const CacheConfig& k) {
  nb::dict f;
  f["device"] = name_of(k.device), f["rows"] = k.rows, f["max_seq_len"] = k.max_seq_len, f["pages"] = k.pages,
  f["max_staged_tokens"] = k.max_staged_tokens, f["stream"] = uintptr_t(k.stream);
  return std::move(f);
}
nb::object to_python(const Tuning& t) { return tuning_fields(t); }
nb::object to_python(const MemoryReport& r) {
  nb::dict f;
  f["storage_bytes"] = r.storage_bytes, f["scale_bytes"] = r.scale_bytes, f["staging_bytes"] = r.staging_bytes,
  f["bookkeeping_bytes"] = r.bookkeeping_bytes, f["overhead_bytes"] = r.overhead_bytes();
  return std::move(f);
}
nb::object to_python(int64_t v) { return nb::int_(v); }
nb::object to_python(int v) { return nb::int_(v); }

// Facts without arguments: a property or a method, converted by to_python.
template <class R> const char* bind_family(CacheClass& cls, const char* name, PythonForm form, R (Cache::*op)() const,
                                           const Names&) {
  auto get = [op](const Cache& c) { return to_python((c.*op)()); };
  form == PythonForm::property ? (void)cls.def_prop_ro(name, get) : (void)cls.def(name, get);
  return "fact";
}
// The descriptor: a reference into static data, which the cache's Python object keeps alive.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, const VariantDescriptor& (Cache::*op)() const,
                        const Names&) {
  cls.def_prop_ro(name, [op](const Cache& c) -> const VariantDescriptor& { return (c.*op)(); },
                  nb::rv_policy::reference_internal);
  return "fact";
}
// Whole-cache operations: commit, reset, synchronize.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(), const Names&) {
  cls.def(name, op, Release());
  return "whole";
}
// One integer in: reset_row, row_length.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int64_t), const Names& a) {
  cls.def(name, op, nb::arg(a[0]), Release());
  return "integer";
}
const char* bind_family(CacheClass& cls, const char* name, PythonForm, int64_t (Cache::*op)(int64_t) const,
                        const Names& a) {
  cls.def(name, op, nb::arg(a[0]), Release());
  return "integer";
}
// One index array: reorder, copy_blocks.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(const IndexView&),
                        const Names& a) {
  const char* arg = a[0];
  cls.def(name, [op, arg](Cache& c, nb::handle h) {
    const IndexView v = index_view(h, arg);
    nb::gil_scoped_release unlocked;
    (c.*op)(v);
  }, nb::arg(arg));
  return "indices";
}
// A layer's two scales: set_tensor_scale.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, float, float),
                        const Names& a) {
  cls.def(name, [op](Cache& c, int64_t layer, float k, float v) {
    const int l = layer_arg(c, layer);
    nb::gil_scoped_release unlocked;
    (c.*op)(l, k, v);
  }, nb::arg(a[0]), nb::arg(a[1]), nb::arg(a[2]));
  return "layer_scales";
}
// Writes of T tokens: append (K and V).
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, const TensorView&,
                        const TensorView&, const TokenTargets&), const Names& a) {
  const char *k = a[1], *v = a[2];
  const TargetNames targets(a[3]);
  cls.def(name, [=](Cache& c, int64_t layer, nb::handle kh, nb::handle vh, nb::handle rows, nb::handle positions,
                    nb::handle slots) {
    const TokenTargets t = targets.from(rows, positions, slots);
    const TensorView kv = tensor_view(kh, k, Access::read), vv = tensor_view(vh, v, Access::read);
    nb::gil_scoped_release unlocked;
    (c.*op)(layer_arg(c, layer), kv, vv, t);
  }, nb::arg(a[0]), nb::arg(k).none(), nb::arg(v).none(), "rows"_a = nb::none(), "positions"_a = nb::none(),
     "slots"_a = nb::none());
  return "tensors_in";
}
// Writes of T records: append_record, append_latent.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, const TensorView&,
                        const TokenTargets&), const Names& a) {
  const char* record = a[1];
  const TargetNames targets(a[2]);
  cls.def(name, [=](Cache& c, int64_t layer, nb::handle h, nb::handle rows, nb::handle positions, nb::handle slots) {
    const TokenTargets t = targets.from(rows, positions, slots);
    const TensorView rv = tensor_view(h, record, Access::read);
    nb::gil_scoped_release unlocked;
    (c.*op)(layer_arg(c, layer), rv, t);
  }, nb::arg(a[0]), nb::arg(record).none(), "rows"_a = nb::none(), "positions"_a = nb::none(), "slots"_a = nb::none());
  return "tensors_in";
}
// Reads of a range into K and V: gather. The range comes after the outputs, with row 0 and begin 0 unless
// given, as a sequence's reads are written (cache.gather(layer, k, v, pages=p, end=n)).
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, const GatherRange&,
                        const TensorView&, const TensorView&), const Names& a) {
  const char *pages_name = field_of(a[1], "pages"), *k = a[2], *v = a[3];
  cls.def(name, [=](Cache& c, int64_t layer, nb::handle kh, nb::handle vh, int64_t row, nb::handle pages,
                    int64_t begin, int64_t end) {
    const GatherRange r{row, optional_index(pages, pages_name), begin, end};
    const TensorView ko = tensor_view(kh, k, Access::written), vo = tensor_view(vh, v, Access::written);
    nb::gil_scoped_release unlocked;
    (c.*op)(layer_arg(c, layer), r, ko, vo);
  }, nb::arg(a[0]), nb::arg(k).none(), nb::arg(v).none(), "row"_a = 0, "pages"_a = nb::none(), "begin"_a = 0, "end"_a);
  return "tensors_out";
}
// Reads of a range of records: gather_record, gather_latent.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, const GatherRange&,
                        const TensorView&), const Names& a) {
  const char *pages_name = field_of(a[1], "pages"), *out = a[2];
  cls.def(name, [=](Cache& c, int64_t layer, nb::handle h, int64_t row, nb::handle pages, int64_t begin,
                    int64_t end) {
    const GatherRange r{row, optional_index(pages, pages_name), begin, end};
    const TensorView o = tensor_view(h, out, Access::written);
    nb::gil_scoped_release unlocked;
    (c.*op)(layer_arg(c, layer), r, o);
  }, nb::arg(a[0]), nb::arg(out).none(), "row"_a = 0, "pages"_a = nb::none(), "begin"_a = 0, "end"_a);
  return "tensors_out";
}
// Attention over a layer in place: attend. The batch's arrays and the options are keyword arguments named
// as their fields; a page table may be [B, max_pages] (vLLM's block_tables) or flat with max_pages given;
// lse is [T, q_heads] fp32 and sinks [q_heads] fp32, each optional.
IndexView page_table_view(nb::handle obj, const char* argument, int64_t& max_pages) {
  if (obj.is_none()) return IndexView{};
  const ArrayArg a = array_arg(obj, argument, Access::read);
  if (a.t.ndim != 2) return index_view(obj, argument);
  if (a.shape(0) > 1 && a.stride(0) != a.shape(1)) throw ShapeError(argument, "its rows must be contiguous and adjacent");
  if (a.shape(1) > 1 && a.stride(1) != 1) throw ShapeError(argument, "must be contiguous (stride 1)");
  max_pages = a.shape(1);
  return IndexView{a.data(), dtype_of_array(a, argument), device_of_array(a, argument), a.shape(0) * a.shape(1)};
}
// A 1-D (sinks: [1, 1, n]) or 2-D (lse: [t, n, 1]) array as the rank-3 view attend checks.
TensorView widened_view(nb::handle obj, const char* argument, Access access, int rank) {
  if (obj.is_none()) return TensorView{};
  const ArrayArg a = array_arg(obj, argument, access);
  if (a.t.ndim != rank)
    throw ShapeError(argument, "expected " + std::to_string(rank) + " dimensions, got " + std::to_string(a.t.ndim));
  TensorView t;
  t.data = a.data();
  t.dtype = dtype_of_array(a, argument);
  t.device = device_of_array(a, argument);
  if (rank == 1) {
    t.shape = {1, 1, a.shape(0)};
    t.stride = {a.shape(0), a.shape(0), a.stride(0)};
  } else {
    t.shape = {a.shape(0), a.shape(1), 1};
    t.stride = {a.stride(0), a.stride(1), 1};
  }
  return t;
}
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(int, const TensorView&,
                        const AttendBatch&, const AttendOptions&, const TensorView&, const TensorView&), const Names& a) {
  const char *q = a[1], *out = a[4], *lse = a[5];
  const char *starts = field_of(a[2], "query_start"), *lengths = field_of(a[2], "lengths"),
             *positions = field_of(a[2], "positions"), *rows = field_of(a[2], "rows"), *begins = field_of(a[2], "begins"),
             *table = field_of(a[2], "page_table"), *sinks = field_of(a[3], "sinks");
  cls.def(name, [=](Cache& c, int64_t layer, nb::handle qh, nb::handle oh, nb::handle start_h, nb::handle length_h,
                    nb::handle position_h, nb::handle row_h, nb::handle table_h, int64_t max_pages, nb::handle lse_h,
                    float scale, bool causal, int window, float softcap, nb::handle sink_h, int64_t max_query_len,
                    int64_t max_kv_len, nb::handle begin_h) {
    AttendBatch b;
    b.query_start = index_view(start_h, starts);
    b.lengths = index_view(length_h, lengths);
    b.positions = optional_index(position_h, positions);
    b.rows = optional_index(row_h, rows);
    b.begins = optional_index(begin_h, begins);
    b.max_pages = max_pages;
    b.page_table = page_table_view(table_h, table, b.max_pages);
    b.max_query_len = max_query_len;
    b.max_kv_len = max_kv_len;
    AttendOptions o;
    o.scale = scale, o.causal = causal, o.window = window, o.softcap = softcap;
    o.sinks = widened_view(sink_h, sinks, Access::read, 1);
    const TensorView qv = tensor_view(qh, q, Access::read), ov = tensor_view(oh, out, Access::written);
    const TensorView lv = widened_view(lse_h, lse, Access::written, 2);
    nb::gil_scoped_release unlocked;
    (c.*op)(layer_arg(c, layer), qv, b, o, ov, lv);
  }, nb::arg(a[0]), nb::arg(q).none(), nb::arg(out).none(), "query_start"_a, "lengths"_a, "positions"_a = nb::none(),
     "rows"_a = nb::none(), "page_table"_a = nb::none(), "max_pages"_a = 0, "lse"_a = nb::none(), "scale"_a = 0.0f,
     "causal"_a = true, "window"_a = 0, "softcap"_a = 0.0f, "sinks"_a = nb::none(), "max_query_len"_a = 0,
     "max_kv_len"_a = 0, "begins"_a = nb::none());
  return "attend";
}
// A hybrid cache's layer groups: a member cache by index, and where a layer lies.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, Cache& (Cache::*op)(int), const Names& a) {
  cls.def(name, op, nb::arg(a[0]), nb::rv_policy::reference_internal);
  return "group";
}
const char* bind_family(CacheClass& cls, const char* name, PythonForm, int (Cache::*op)(int) const, const Names& a) {
  cls.def(name, op, nb::arg(a[0]));
  return "group_of";
}
// A layer's raw pointers, as DLPack arrays that keep the cache alive: view.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, LayerView (Cache::*)(int) const,
                        const Names& a) {
  cls.def(name, [](nb::handle self, int64_t layer) {
    const Cache& c = nb::cast<const Cache&>(self);
    return layer_view(c, layer_arg(c, layer), self);
  }, nb::arg(a[0]));
  return "view";
}
// Packed pages out and in: pack_pages, unpack_pages (the buffer is checked against the pages' bytes).
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(const IndexView&, void*),
                        const Names& a) {
  const char *pages = a[0], *packed = a[1];
  cls.def(name, [=](Cache& c, nb::handle ph, nb::handle packed_h) {
    const IndexView p = index_view(ph, pages);
    void* out = packed_bytes(c, p, packed_h, Access::written);
    nb::gil_scoped_release unlocked;
    (c.*op)(p, out);
  }, nb::arg(pages).none(), nb::arg(packed).none());
  return "pack";
}
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(const void*, const IndexView&),
                        const Names& a) {
  const char *packed = a[0], *pages = a[1];
  cls.def(name, [=](Cache& c, nb::handle packed_h, nb::handle ph) {
    const IndexView p = index_view(ph, pages);
    const void* in = packed_bytes(c, p, packed_h, Access::read);
    nb::gil_scoped_release unlocked;
    (c.*op)(in, p);
  }, nb::arg(packed).none(), nb::arg(pages).none());
  return "unpack";
}
// The CUDA stream later operations are queued on, as an integer handle (torch: stream.cuda_stream).
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(void*), const Names& a) {
  cls.def(name, [op](Cache& c, uintptr_t stream) { (c.*op)(reinterpret_cast<void*>(stream)); }, nb::arg(a[0]));
  return "stream";
}
// Launch parameters as keyword arguments named as Cache.tuning's keys (the backend table's tunables);
// those not given keep their values.
const char* bind_family(CacheClass& cls, const char* name, PythonForm, void (Cache::*op)(const Tuning&), const Names&) {
  cls.def(name, [op](Cache& c, const nb::kwargs& given) { (c.*op)(tuning_from(c.tuning(), given)); });
  return "tuning";
}

// Each bound row's family, by name, for kvforge._cache_ops (kvforge/ops.py makes the torch ops from it).
std::map<std::string, const char*>& row_families() {
  static std::map<std::string, const char*> families;
  return families;
}

// One row: bound by its signature's family, unless the row is C++ only (whose signature then needs none).
template <PythonForm Form, class Op> void bind_row(CacheClass& cls, const char* name, Op op, const char* arguments) {
  if constexpr (Form != PythonForm::none)
    row_families()[name] = bind_family(cls, name, Form, op, row_arguments(arguments));
}

// A row as kvforge._cache_ops gives it: (name, route, python, family or None, [argument names]).
nb::tuple row_description(const char* name, const char* route, const char* python, const char* arguments) {
  const auto family = row_families().find(name);
  nb::list names;
  for (const char* a : row_arguments(arguments)) names.append(a);
  const nb::object bound = family == row_families().end() ? nb::object(nb::none()) : nb::str(family->second);
  return nb::make_tuple(name, route, python, bound, names);
}

}  // namespace
}  // namespace kvforge
