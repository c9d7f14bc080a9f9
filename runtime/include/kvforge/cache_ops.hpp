// The one list of the cache's operations (docs/contract.md). Every cache declares its virtuals from it:
// Cache (cache.hpp), TypedCache (cache_impl.hpp), and the two caches made of member caches, HybridCache
// (hybrid_cache.hpp) and PairedCache (paired_cache.hpp), which also route each op by its row's `route`.
// kvforge.Cache's methods are bound from the rows, each by its signature's family (python/src/rows.hpp);
// Python lists them (kvforge._cache_ops), and tests/python/test_cache_ops.py holds kvforge.Cache and
// kvforge.ops to them; a C++ class that lacks a row's definition does not link.
//
// A row: X(route, python, result, name, (parameters), (arguments), qualifier)
//   route: what the op acts on, which says how a cache of member caches serves it:
//     layer   one layer: the member holding `layer` (hybrid: its group's cache, with the layer renumbered
//             within the group; paired: the main cache)
//     whole   the whole cache: every member in turn (paired: the main cache first, which checks)
//     first   a fact of the rows, the storage or the settings: the first member (hybrid: group 0's
//             cache; paired: the main cache)
//     pages   page ids: a hybrid cache refuses it, since its page ids are per group; a pair runs it on
//             both, which share their pages
//     packed  packed pages: a hybrid cache refuses it; a pair writes its own (its pages are both caches')
//     own     each composite writes its own
//     derived Cache itself defines it on top of other rows (cache.cpp): no cache overrides it, and a
//             composite serves it through the rows it is built on
//     groups  a hybrid model's layer groups: Cache answers for every cache of one group, itself
//             (cache.cpp); HybridCache overrides it
//   python: method (a method of kvforge.Cache), torch (a method, and a torch op of kvforge.ops), property
//     (an attribute of kvforge.Cache), none (C++ only: Python reads the same through view() and buffers())
//
// Notation in the comments: H = descriptor().heads, D = descriptor().head_dim, L = descriptor().layers,
// P = descriptor().page_size; "on the cache's device" means memory of config().device.
#pragma once

// clang-format off
#define KVFORGE_CACHE_OPS(X)                                                                                   \
  X(own, property, const VariantDescriptor&, descriptor, (), (), const)                                        \
  X(first, property, const CacheConfig&, config, (), (), const)                                                \
  X(first, none, const Geometry&, geometry, (), (), const)                                                     \
  /* Writes T new tokens of one layer.                                                                      \
       layer:   [0, L)                                                                                      \
       k, v:    [T, H, D], the input dtype (descriptor().input), on the cache's device; T >= 0              \
       targets: one entry per token, on the cache's device, -1 = padding (skipped):                         \
                contiguous and ring: rows int32 [T] in [0, config().rows), positions int32 [T] in           \
                [0, max_seq_len) (contiguous) or >= 0 (ring: cell = position mod window; a position below   \
                row_length - window is dropped); paged: slots int64 [T] in [0, pages * P),                  \
                slot = page * P + offset in page.                                                           \
     Lazy variants stage the tokens (at most max_staged_tokens per layer between commits). */               \
  X(layer, torch, void, append, (int layer, const TensorView& k, const TensorView& v, const TokenTargets& targets), \
    (layer, k, v, targets), )                                                                                  \
  /* Lazy variants: writes every layer's staged tokens in one launch. Eager variants: nothing to do. */     \
  X(whole, torch, void, commit, (), (), )                                                                      \
  /* Reads positions [range.begin, range.end) of one sequence of one layer, dequantized.                    \
       layer:        [0, L)                                                                                 \
       range:        begin >= 0, end >= begin; contiguous: range.row in [0, rows), end <= max_seq_len;      \
                     ring: end <= row_length(row) and begin >= row_length(row) - window; paged:             \
                     range.pages int32 [>= ceil(end / P)] on the cache's device, the sequence's page list   \
                     (only the entries the range touches must be valid pages)                               \
       k_out, v_out: [H, end - begin, D], the input dtype, on the cache's device */                         \
  X(layer, torch, void, gather, (int layer, const GatherRange& range, const TensorView& k_out, const TensorView& v_out), \
    (layer, range, k_out, v_out), )                                                                            \
  /* Attention over one layer's history where it lies, read in its storage dtype (docs/attention.md):   \
     out = softmax(scale * q . K^T, masked) . V per query head, K and V of the query head's KV head.      \
       layer:   [0, L)                                                                                  \
       q:       [T, QH, Dk], the input dtype, on the cache's device; QH a multiple of H (GQA, MQA; MLA:   \
                any). Dk: head_dim; MLA's absorbed form mla_kv_lora_rank + mla_rope_dim; else k_head_dim \
       batch:   attend.hpp's AttendBatch: query_start int32 [B + 1], lengths int32 [B] in [1, capacity], \
                positions int32 [T] or empty (the newest), rows int32 [B] (contiguous, ring) or           \
                page_table int32 [B * max_pages] (paged), on the cache's device                           \
       options: scale, causal, window, softcap, sinks (attend.hpp)                                       \
       out:     [T, QH, Dv], the input dtype: Dv = head_dim, mla_kv_lora_rank (MLA), or v_head_dim       \
       lse:     [T, QH, 1] fp32: each row's log-sum-exp (natural log, sinks included), or data = null    \
     A ring refuses positions that have left its window; nothing is written on a refused call. */        \
  X(layer, torch, void, attend, (int layer, const TensorView& q, const AttendBatch& batch, const AttendOptions& options, const TensorView& out, const TensorView& lse), \
    (layer, q, batch, options, out, lse), )                                                                   \
  /* Zeros every layer, scales and row lengths (per-tensor and tensor scales are kept). */                  \
  X(whole, method, void, reset, (), (), )                                                                      \
  /* Zeros one row of every layer; row in [0, rows). Contiguous and ring only (else UnsupportedError). */   \
  X(first, method, void, reset_row, (int64_t row), (row), )                                                    \
  /* New row i takes old row beam[i]: beam int32 [rows], each in [0, rows), on the cache's device.          \
     Contiguous and ring only. */                                                                           \
  X(first, method, void, reorder, (const IndexView& beam), (beam), )                                          \
  /* For each pair (src, dst), page dst of every layer becomes a copy of page src: pairs int32 [2n], pages  \
     in [0, config().pages), no page a destination twice or both source and destination. Paged only. */    \
  X(pages, torch, void, copy_blocks, (const IndexView& pairs), (pairs), )                                      \
  /* Raw pointers and element strides of one layer (layer in [0, L)), for attention kernels. */             \
  X(layer, method, LayerView, view, (int layer), (layer), const)                                               \
  /* Paged layouts: bytes one page of every layer takes packed, codes and scales (offload moves these). */  \
  X(packed, method, int64_t, packed_page_bytes, (), (), const)                                                 \
  /* Page pages[i] of every layer goes to packed + i * packed_page_bytes(), or comes back from there.       \
       pages:  int32 [n] in [0, config().pages), on the cache's device                                      \
       packed: n * packed_page_bytes() bytes of the cache's device's memory. One launch each. Paged only. */\
  X(packed, method, void, pack_pages, (const IndexView& pages, void* packed), (pages, packed), )                \
  X(packed, method, void, unpack_pages, (const void* packed, const IndexView& pages), (packed, pages), )        \
  /* per_tensor quantized layouts: the static scales of one layer (layer in [0, L)); tensor-scaled          \
     per_group layouts (NVFP4): the second-level scale under that layer's group scales, which codes         \
     already written are read with too. Held in device memory so a captured graph picks up new values;      \
     both finite and > 0. Others: UnsupportedError. */                                                      \
  X(layer, method, void, set_tensor_scale, (int layer, float k_scale, float v_scale), (layer, k_scale, v_scale), ) \
  /* The highest position written to a row (row in [0, rows)), plus one; 0 after reset. Contiguous and     \
     ring only. Synchronizes on CUDA. */                                                                    \
  X(first, method, int64_t, row_length, (int64_t row), (row), const)                                           \
  /* Waits for queued work and raises any error a device-side check found (CUDA only). */                   \
  X(whole, method, void, synchronize, (), (), )                                                                \
  X(own, method, MemoryReport, memory, (), (), const)                                                          \
  /* Raw storage pool; for tests and tools that read physical bytes. */                                     \
  X(first, none, const void*, storage, (), (), const)                                                          \
  /* The scale buffer beside the pool (separate or per_tensor scales), else null. */                        \
  X(first, none, const void*, scale_storage, (), (), const)                                                    \
  /* A tensor-scaled layout's second-level scales, [layers, 2] fp32 (K then V of each layer) in the         \
     cache's device memory, for an attention kernel to read; else null. */                                  \
  X(first, none, const float*, tensor_scale_storage, (), (), const)                                            \
  /* The stream every later operation is queued on: a cudaStream_t on CUDA (a graph captured on it records  \
     the operations captured there), ignored on the CPU. The caller orders the switch: work queued on the   \
     old stream is not waited for. */                                                                       \
  X(whole, method, void, set_stream, (void* stream), (stream), )                                               \
  /* Launch parameters now in force. set_tuning checks each against the range a tuning file is held to      \
     (vocab.hpp's tunables; OutOfRangeError or ArgumentError naming the field) before changing anything. */ \
  X(first, property, Tuning, tuning, (), (), const)                                                            \
  X(whole, method, void, set_tuning, (const Tuning& t), (t), )                                                \
  /* Variants whose token is one record a head (descriptor().records()): an MLA model's latent, R =         \
     mla_kv_lora_rank values then P = mla_rope_dim, in one head; or K then V of different widths,           \
     k_head_dim + v_head_dim values, in each head. The record is K then V of head_dim = half of it, so      \
     these are append and gather of its two halves, and every check and error is theirs (naming record or  \
     record_out). A record's parts are views of it: K = record[..., :k_head_dim], V = record[...,          \
     k_head_dim:]. Other variants: UnsupportedError. A record of odd width W is stored with one zero after  \
     it (head_dim = (W + 1) / 2): these take W values, through a padded copy of the records (synchronizing  \
     the cache), or 2 * head_dim, straight through.                                                         \
       record:     [T, heads, W or 2 * head_dim], as append's k                                             \
       record_out: [heads, end - begin, W or 2 * head_dim], as gather's k_out */                            \
  X(derived, torch, void, append_record, (int layer, const TensorView& record, const TokenTargets& targets), \
    (layer, record, targets), )                                                                                \
  X(derived, torch, void, gather_record, (int layer, const GatherRange& range, const TensorView& record_out), \
    (layer, range, record_out), )                                                                              \
  /* The same for an MLA variant alone, whose record has one head (else UnsupportedError).                  \
       latent:     [T, 1, R + P] (or its even width, as above)                                              \
       latent_out: [1, end - begin, R + P] */                                                               \
  X(derived, torch, void, append_latent, (int layer, const TensorView& latent, const TokenTargets& targets), \
    (layer, latent, targets), )                                                                                \
  X(derived, torch, void, gather_latent, (int layer, const GatherRange& range, const TensorView& latent_out), \
    (layer, range, latent_out), )                                                                              \
  /* Hybrid variants keep one member cache per layer group; every other cache is its own only group.        \
     g in [0, num_groups()); layer in [0, L). group_layer: the layer's index within its group. */           \
  X(groups, property, int, num_groups, (), (), const)                                                          \
  X(groups, method, Cache&, group, (int g), (g), )                                                             \
  X(groups, method, int, group_of, (int layer), (layer), const)                                                \
  X(groups, method, int, group_layer, (int layer), (layer), const)
// clang-format on

// A row as a declaration: in Cache, a pure virtual (a derived row: a member Cache defines); in every
// implementation, its override (a derived row: none).
#define KVFORGE_CACHE_OP_PURE(route, python, result, name, params, args, qualifier) \
  KVFORGE_CACHE_OP_IN_CACHE_##route(result name params qualifier)
#define KVFORGE_CACHE_OP_OVERRIDE(route, python, result, name, params, args, qualifier) \
  KVFORGE_CACHE_OP_IN_IMPLEMENTATION_##route(result name params qualifier)
#define KVFORGE_CACHE_OP_ABSTRACT(declaration) virtual declaration = 0;
#define KVFORGE_CACHE_OP_OVERRIDDEN(declaration) declaration override;
#define KVFORGE_CACHE_OP_IN_CACHE_layer KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_whole KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_first KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_pages KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_packed KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_own KVFORGE_CACHE_OP_ABSTRACT
#define KVFORGE_CACHE_OP_IN_CACHE_derived(declaration) declaration;
#define KVFORGE_CACHE_OP_IN_CACHE_groups(declaration) virtual declaration;
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_layer KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_whole KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_first KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_pages KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_packed KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_own KVFORGE_CACHE_OP_OVERRIDDEN
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_derived(declaration)
#define KVFORGE_CACHE_OP_IN_IMPLEMENTATION_groups(declaration)
