// kvforge._native: the runtime's public API (kvforge.hpp) for Python, over DLPack. This file only
// translates: DLPack arrays in and out as the runtime's views, Python values as its config structs,
// its typed errors as the Python classes of kvforge/errors.py. Every check stays in the runtime, so a
// refused call raises before anything is written, as from C++. It is torch-free: any __dlpack__
// producer goes in, and what comes out is a DLPack-capable array torch.from_dlpack() or numpy take.
// nanobind's ndarray is the one FFI type here (translate.hpp holds the conversions), so another binding
// layer would change only these two files.
#include "batch.hpp"
#include "events.hpp"
#include "physical.hpp"
#include "rows.hpp"
#include "states.hpp"
#include "translate.hpp"
#include "views.hpp"

NB_MODULE(_native, m) {
  using namespace kvforge;
  m.doc() = "kvforge's runtime over DLPack (see kvforge/__init__.py for the Python API)";
  nb::register_exception_translator(translate);
  // Descriptors are references to static data, often still held by module globals at exit, which
  // nanobind would report as leaks.
  nb::set_leak_warnings(false);

  m.def("variants", [](std::optional<std::string> layout, std::optional<std::string> model,
                       std::optional<std::string> storage, std::optional<std::string> input) {
    const VariantQuery q = query_of(layout, model, storage, input);
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
    const VariantQuery q = query_of(std::nullopt, std::nullopt, storage, input);
    return q.record.empty() ? variant_name(layout, model, *q.storage, *q.input) : variant_name(layout, model, q.record, *q.input);
  });

  nb::class_<VariantDescriptor>(m, "Descriptor")
      .def_prop_ro("name", [](const VariantDescriptor& d) { return d.name; })
      .def_prop_ro("layout", [](const VariantDescriptor& d) { return d.layout; })
      .def_prop_ro("model", [](const VariantDescriptor& d) { return d.model; })
      .def_prop_ro("storage", [](const VariantDescriptor& d) { return std::string(d.storage_name()); })
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
      .def_ro("quant_group", &VariantDescriptor::quant_group, "per_group: values of a head's row that share a scale; else 0")
      .def_ro("tensor_scaled", &VariantDescriptor::tensor_scaled,
              "per_group scales under a second-level fp32 scale per layer and K/V (NVFP4), set with set_tensor_scale")
      .def_prop_ro("scale_dtype", [](const VariantDescriptor& d) {
        return d.quantized() ? std::optional<std::string>(name(scale_value_dtype(d.scale))) : std::nullopt;
      }, "the dtype of each stored scale (and of its zero point, where `zero_point`)")
      .def_prop_ro("zero_point", [](const VariantDescriptor& d) { return is_zero_point_scale(d.scale); },
                   "asymmetric codes (uint4): each scale entry is a scale and a zero point, value = (code - zero) * scale")
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
      // A hybrid model's linear layers (its spec's linear_layers): `layers` counts the attention ones.
      .def_prop_ro("model_layers", [](const VariantDescriptor& d) { return d.states ? d.states->model_layers : d.layers; })
      .def_prop_ro("linear_layers", [](const VariantDescriptor& d) {
        return d.states ? std::vector<int>(d.states->linear_layers, d.states->linear_layers + d.states->num_linear)
                        : std::vector<int>{};
      })
      .def_prop_ro("state_axes", [](const VariantDescriptor& d) { return state_axes_tuple(d.state_axes); })
      // How tensor parallelism splits each part (its spec's shard_axis): the axis, -1 whole on every rank,
      // -2 a shape per degree (shard_shapes).
      .def_prop_ro("state_shard_axes", [](const VariantDescriptor& d) {
        std::vector<int> out;
        for (int i = 0; d.states && i < d.states->num_parts; ++i) out.push_back(d.states->parts[i].shard_axis);
        return out;
      })
      .def_prop_ro("state_parts", [](const VariantDescriptor& d) {
        nb::list out;
        if (d.states)
          for (const StatePart& p : state_parts(d)) out.append(nb::make_tuple(p.name, nb::tuple(nb::cast(p.shape)), name(p.dtype)));
        return out;
      })
      // An MLA model's latent record (its spec's mla): (kv_lora_rank, qk_rope_head_dim), else None.
      .def_prop_ro("mla", [](const VariantDescriptor& d) {
        return d.mla() ? std::optional<std::pair<int, int>>({d.mla_kv_lora_rank, d.mla_rope_dim}) : std::nullopt;
      })
      // A model whose K and V differ in width (its spec's v_head_dim): (head_dim, v_head_dim) of the model,
      // each head's record K then V; else None.
      .def_prop_ro("kv_widths", [](const VariantDescriptor& d) {
        return d.split_widths() ? std::optional<std::pair<int, int>>({d.k_head_dim, d.v_head_dim}) : std::nullopt;
      })
      // A record format's parts (a layout spec's `records`; docs/specs.md "Records of named parts"), each a
      // dict of its placement in the record: name, values_at, width, dtype, bytes_at, and a coded part's
      // group, scale_dtype, scales_at, at_page_end, rounding, amax_floor, nan_group; else None.
      .def_prop_ro("record_parts", [](const VariantDescriptor& d) -> std::optional<nb::list> {
        if (!d.record_format) return std::nullopt;
        nb::list parts;
        for (int i = 0; i < d.record_format->num_parts; ++i) {
          const RecordPart& p = d.record_format->parts[i];
          nb::dict part;
          part["name"] = p.name, part["values_at"] = p.values_at, part["width"] = p.width;
          part["dtype"] = name(p.dtype), part["bytes_at"] = p.bytes_at;
          if (p.scaled()) {
            part["group"] = p.group, part["scale_dtype"] = name(p.scale_dtype), part["scales_at"] = p.scales_at;
            part["at_page_end"] = p.at_page_end, part["amax_floor"] = p.amax_floor, part["nan_group"] = p.nan_group;
            part["rounding"] = p.rounding == ScaleRounding::pow2_up ? "pow2_up" : "exact";
          }
          parts.append(part);
        }
        return parts;
      })
      .def("__repr__", [](const VariantDescriptor& d) { return std::string("<kvforge.Descriptor ") + d.name + ">"; });

  // Every row of the operations table (cache_ops.hpp), bound by its signature (rows.hpp); then what
  // Python adds over the rows.
  nb::class_<Cache> cache_class(m, "Cache");
#define KVFORGE_BIND_ROW(route, python, result, name, params, args, qualifier) \
  bind_row<PythonForm::python>(cache_class, #name, &Cache::name, #args);
  KVFORGE_CACHE_OPS(KVFORGE_BIND_ROW)
#undef KVFORGE_BIND_ROW
  cache_class
      .def("gather_batch", [](Cache& c, int64_t layer, nb::handle k_out, nb::handle v_out, const std::vector<int64_t>& rows,
                              nb::handle page_table, int64_t begin, int64_t end) {
        gather_batch(c, layer_arg(c, layer), k_out, v_out, rows, page_table, begin, end);
      }, "layer"_a, "k_out"_a.none(), "v_out"_a.none(), "rows"_a = std::vector<int64_t>{}, "page_table"_a = nb::none(),
         "begin"_a = 0, "end"_a)
      .def("buffers", [](nb::handle self) {
        nb::list out;
        raw_buffers(nb::cast<const Cache&>(self), self, out);
        return out;
      })
      .def("physical_placement", [](const Cache& c, int64_t tokens, nb::handle pages, int64_t row) {
        const IndexView p = optional_index(pages, "pages");
        if (tokens < 1) throw OutOfRangeError("tokens", tokens, 1, int64_t(1) << 40);
        if (c.descriptor().is_hybrid()) return placement_dict(std::nullopt);  // no one placement: a group has one
        check_physical_range(c, GatherRange{row, p, 0, tokens}, tokens);
        // kvforge.nixl registers host memory: a device cache's placement would name memory it cannot reach.
        if (c.config().device != Device::cpu) return placement_dict(std::nullopt);
        return placement_dict(physical_placement(c, static_cast<const int32_t*>(p.data), row, tokens));
      }, "tokens"_a, "pages"_a = nb::none(), "row"_a = 0)
      .def("write_physical", [](const Cache& c, int64_t layer, int64_t tokens, const nb::dict& placement, nb::handle out,
                                nb::handle pages, int64_t row, int64_t head_offset, int64_t heads) {
        write_physical_from(c, layer_arg(c, layer), tokens, placement, out, optional_index(pages, "pages"), row, head_offset,
                            heads);
      }, "layer"_a, "tokens"_a, "placement"_a, "out"_a, "pages"_a = nb::none(), "row"_a = 0, "head_offset"_a = 0,
         "heads"_a = -1)
      // A PairedCache's companion (kvforge.create(..., companion=...)), else None.
      .def_prop_ro("companion", [](Cache& c) -> Cache* {
        auto* paired = dynamic_cast<PairedCache*>(&c);
        return paired ? &paired->companion() : nullptr;
      }, nb::rv_policy::reference_internal);

  m.def("pair", [](std::unique_ptr<Cache> main, std::unique_ptr<Cache> companion) -> std::unique_ptr<Cache> {
    return std::make_unique<PairedCache>(std::move(main), std::move(companion));
  }, "main"_a, "companion"_a, "The two caches as one over the same pages; both arguments are consumed.");

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
    return known().create(query_of(layout, model, storage, input), config);
  }, "name"_a = nb::none(), "layout"_a = nb::none(), "model"_a = nb::none(), "storage"_a = nb::none(),
     "input"_a = nb::none(), "device"_a = "cpu", "rows"_a = 1, "max_seq_len"_a = 0, "pages"_a = 0,
     "max_staged_tokens"_a = 0, "stream"_a = 0);

  bind_states(m);

  m.def("plan_memory", [](const std::string& name, const std::string& mode, const std::string& device, int64_t pages,
                          int64_t reserve_bytes, int64_t budget_bytes, int64_t state_slot_bytes, int64_t state_slots,
                          int64_t state_checkpoints) {
    static const char* const kModes[] = {"allocate", "reserve"};
    MemoryRequest r;
    r.mode = enum_from<PlanMode>(mode, kModes, "mode");
    r.device = device_named(device);
    r.pages = pages, r.reserve_bytes = reserve_bytes, r.budget_bytes = budget_bytes;
    r.state_slot_bytes = state_slot_bytes, r.state_slots = state_slots, r.state_checkpoints = state_checkpoints;
    const MemoryPlan p = plan_memory(*known().at(name).descriptor, r);
    nb::dict f;
    f["pages"] = p.pages, f["page_bytes"] = p.page_bytes, f["pool_bytes"] = p.pool_bytes, f["tokens"] = p.tokens,
    f["page_size"] = p.page_size, f["state_bytes"] = p.state_bytes;
    return f;
  }, "name"_a, "mode"_a = "allocate", "device"_a = "cpu", "pages"_a = 0, "reserve_bytes"_a = 0, "budget_bytes"_a = 0,
     "state_slot_bytes"_a = 0, "state_slots"_a = 0, "state_checkpoints"_a = 0);

  nb::class_<SequenceManager>(m, "SequenceManager")
      .def("__init__", [](SequenceManager* self, Cache& cache, bool prefix_caching, uint64_t salt, int32_t host_blocks,
                          int32_t window, bool kv_events, int default_priority, bool demote_to_host,
                          const std::string& disk_path, int64_t disk_blocks, int32_t read_ahead_blocks,
                          const std::string& block_hash, const std::string& hash_seed, bool promote_ahead,
                          const std::string& weights_tag) {
        SequenceManagerOptions o = manager_options(prefix_caching, salt, host_blocks, window, block_hash, hash_seed);
        o.kv_events = kv_events, o.default_priority = default_priority, o.demote_to_host = demote_to_host;
        o.disk_path = disk_path, o.disk_blocks = disk_blocks, o.read_ahead_blocks = read_ahead_blocks;
        o.promote_ahead = promote_ahead, o.weights_tag = weights_tag;
        new (self) SequenceManager(cache, o);
      }, "cache"_a, "prefix_caching"_a = true, "salt"_a = 0, "host_blocks"_a = 0, "window"_a = 0,
         "kv_events"_a = false, "default_priority"_a = kDefaultPriority, "demote_to_host"_a = true,
         "disk_path"_a = "", "disk_blocks"_a = 0, "read_ahead_blocks"_a = SequenceManagerOptions{}.read_ahead_blocks,
         "block_hash"_a = "kvforge", "hash_seed"_a = SequenceManagerOptions{}.hash_seed, "promote_ahead"_a = false,
         "weights_tag"_a = "", nb::keep_alive<1, 2>())
      .def_prop_ro("disk_identity", &SequenceManager::disk_identity)
      .def_prop_ro("last_disk_error", &SequenceManager::last_disk_error)
      // ranges: (begin, end, priority[, seconds]) each; see RetentionRange (sequence_manager.hpp).
      .def("set_retention", [](SequenceManager& s, int64_t seq, nb::handle ranges) {
        s.set_retention(seq, retention_ranges(ranges));
      }, "seq"_a, "ranges"_a)
      // The KV events since the last call, as dictionaries with vLLM's field names (kvforge.kv_events).
      .def("take_kv_events", [](SequenceManager& s) { return event_list(s.take_kv_events()); })
      .def("reset_prefix_cache", &SequenceManager::reset_prefix_cache)
      .def("cached_block_hashes", &SequenceManager::cached_block_hashes)
      .def("host_cached_block_hashes", &SequenceManager::host_cached_block_hashes)
      .def("disk_cached_block_hashes", &SequenceManager::disk_cached_block_hashes)
      .def("add", [](SequenceManager& s, int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
        return s.add(seq, prompt, salt);
      }, "seq"_a, "prompt"_a, "salt"_a = nb::none())
      .def("cached_prefix", [](const SequenceManager& s, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
        return s.cached_prefix(prompt, salt);
      }, "prompt"_a, "salt"_a = nb::none())
      // Reads ahead the disk-tier blocks add(prompt) would promote, on the manager's own thread (the
      // GIL released); returns how many reads were queued.
      .def("prefetch", [](SequenceManager& s, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
        return s.prefetch(prompt, salt);
      }, "prompt"_a, "salt"_a = nb::none(), Release())
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
      // The device pages' generations (BlockAllocator::generations): a view of the manager's own counters,
      // int64 [pages], kept alive by it. kvforge.nixl registers it, so that a pull checks its source's pages.
      .def_prop_ro("page_generations", [](nb::handle self) {
        const BlockAllocator& a = nb::cast<const SequenceManager&>(self).allocator();
        return export_array(a.generations(), DType::i64, Device::cpu, {size_t(a.total())}, {1}, self);
      })
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
        f["restored_pages"] = t.restored_pages, f["demoted_blocks"] = t.demoted_blocks;
        f["promoted_blocks"] = t.promoted_blocks, f["disk_writes"] = t.disk_writes, f["disk_reads"] = t.disk_reads;
        f["disk_misses"] = t.disk_misses, f["read_ahead_hits"] = t.read_ahead_hits;
        f["disk_write_failures"] = t.disk_write_failures;
        f["promoted_ahead"] = t.promoted_ahead;
        return f;
      })
      .def_prop_ro("available_blocks", &SequenceManager::available_blocks)
      .def("take_pages", &SequenceManager::take_pages, "n"_a,
           "Pages outside every sequence from the same free list (evicting cached blocks when it must), all or "
           "nothing: a hybrid model's states kept in the cache's pages.")
      .def("give_pages", &SequenceManager::give_pages, "pages"_a)
      .def_prop_ro("taken_pages", &SequenceManager::taken_pages)
      .def_prop_ro("cached_blocks", &SequenceManager::cached_blocks)
      .def_prop_ro("host_free", &SequenceManager::host_free)
      .def("utilization", &SequenceManager::utilization)
      .def("check_invariants", &SequenceManager::check_invariants);

  nb::class_<HybridSequenceManager>(m, "HybridSequenceManager")
      .def("__init__", [](HybridSequenceManager* self, Cache& cache, bool prefix_caching, uint64_t salt, bool kv_events,
                          const std::string& block_hash, const std::string& hash_seed) {
        SequenceManagerOptions o = manager_options(prefix_caching, salt, 0, 0, block_hash, hash_seed);
        o.kv_events = kv_events;
        new (self) HybridSequenceManager(cache, o);
      }, "cache"_a, "prefix_caching"_a = true, "salt"_a = 0, "kv_events"_a = false, "block_hash"_a = "kvforge",
         "hash_seed"_a = SequenceManagerOptions{}.hash_seed, nb::keep_alive<1, 2>())
      .def("set_retention", [](HybridSequenceManager& s, int64_t seq, nb::handle ranges) {
        s.set_retention(seq, retention_ranges(ranges));
      }, "seq"_a, "ranges"_a)
      .def("take_kv_events", [](HybridSequenceManager& s) { return event_list(s.take_kv_events()); })
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

  // The rows of runtime/include/kvforge/cache_ops.hpp as (name, route, python, family, arguments): the
  // family that bound it (rows.hpp; None for a row C++ keeps), and its C++ argument names. kvforge/ops.py
  // makes the torch ops from them; tests/python/test_cache_ops.py holds kvforge.Cache to them.
  m.def("_cache_ops", [] {
    nb::list rows;
#define KVFORGE_CACHE_OP_ROW(route, python, result, name, params, args, qualifier) \
  rows.append(row_description(#name, #route, #python, #args));
    KVFORGE_CACHE_OPS(KVFORGE_CACHE_OP_ROW)
#undef KVFORGE_CACHE_OP_ROW
    return rows;
  });
  m.def("quant_max", [](const std::string& storage) -> float {
    const float qmax = quant_max(*dtype_named(storage, "storage"));
    if (qmax == 0.0f)
      throw ArgumentError("storage", "'" + storage + "' is not quantized (allowed: int8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4)");
    return qmax;
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
  m.def("cpu_levels_built", [] { return cpu_levels_built(); });
  m.def("set_cpu_threads", [](int64_t threads) {
    if (threads < 0 || threads > INT32_MAX) throw OutOfRangeError("threads", threads, 0, INT32_MAX, -1, "0 is OpenMP's own count");
    set_cpu_threads(int(threads));
  }, "threads"_a, "Bounds the threads one CPU operation uses (0: OpenMP's own count); see docs/python.md.");
  m.def("cpu_threads", [] { return cpu_threads(); }, "The bound in force, resolved: at least 1.");
  m.def("cuda_available", [] { return cuda_available(); });
}
