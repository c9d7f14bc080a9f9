#include "kvforge/paired_cache.hpp"

#include <string>
#include <type_traits>

namespace kvforge {
namespace {

std::string described(const Cache& c) {
  const CacheConfig& k = c.config();
  return std::string(c.descriptor().name) + " (" + (c.descriptor().paged() ? "pages of " + std::to_string(c.descriptor().page_size) + ", " +
                                                    std::to_string(k.pages) + " of them" : "not paged") +
         ", on " + std::string(name_of(k.device)) + ")";
}

// Page i of a pack: the first cache's packed page, then the second's. Each cache packs into its part
// one page at a time, since a cache packs its pages back to back.
template <class Bytes, class Move>
void per_page(const IndexView& pages, Bytes packed, int64_t first_bytes, int64_t page_bytes, Move move) {
  const int64_t es = dtype_size(pages.dtype);
  for (int64_t i = 0; i < pages.size; ++i) {
    const IndexView one{static_cast<const char*>(pages.data) + i * es, pages.dtype, pages.device, 1};
    move(one, packed + i * page_bytes, packed + i * page_bytes + first_bytes);
  }
}

}  // namespace

PairedCache::PairedCache(std::unique_ptr<Cache> main, std::unique_ptr<Cache> companion)
    : main_(std::move(main)), companion_(std::move(companion)) {
  if (!main_ || !companion_) throw ArgumentError("companion", "both caches must exist");
  const Cache &a = *main_, &b = *companion_;
  if (!a.descriptor().paged() || !b.descriptor().paged() || a.descriptor().page_size != b.descriptor().page_size ||
      a.config().pages != b.config().pages || a.config().device != b.config().device || a.descriptor().is_hybrid() ||
      b.descriptor().is_hybrid())
    throw ArgumentError("companion", described(b) + " cannot share the pages of " + described(a) +
                                         " (allowed: two paged, non-hybrid caches of one page size, page count and device)");
}

void PairedCache::pack_pages(const IndexView& pages, void* packed) {
  const int64_t first = main_->packed_page_bytes();
  per_page(pages, static_cast<char*>(packed), first, packed_page_bytes(), [&](const IndexView& one, char* a, char* b) {
    main_->pack_pages(one, a);
    companion_->pack_pages(one, b);
  });
}

void PairedCache::unpack_pages(const void* packed, const IndexView& pages) {
  const int64_t first = main_->packed_page_bytes();
  per_page(pages, static_cast<const char*>(packed), first, packed_page_bytes(),
           [&](const IndexView& one, const char* a, const char* b) {
             main_->unpack_pages(a, one);
             companion_->unpack_pages(b, one);
           });
}

MemoryReport PairedCache::memory() const {
  MemoryReport r = main_->memory();
  return r += companion_->memory();
}

int64_t PairedCache::packed_page_bytes() const { return main_->packed_page_bytes() + companion_->packed_page_bytes(); }

const VariantDescriptor& PairedCache::descriptor() const { return main_->descriptor(); }

// The ops of cache_ops.hpp, each by its route; the `own` and `packed` rows are above. An op on the
// whole cache or on pages runs on the main cache first, which checks every argument, so a refused call
// reaches neither.
#define PAIRED_ROUTE(route, python, result, name, params, args, qualifier) \
  PAIRED_##route(result, name, params, args, qualifier)
#define PAIRED_layer(result, name, params, args, qualifier) \
  result PairedCache::name params qualifier { return main_->name args; }
#define PAIRED_first PAIRED_layer
#define PAIRED_whole(result, name, params, args, qualifier) \
  result PairedCache::name params qualifier {               \
    static_assert(std::is_void_v<result>);                  \
    main_->name args;                                       \
    companion_->name args;                                  \
  }
#define PAIRED_pages PAIRED_whole
#define PAIRED_packed(result, name, params, args, qualifier)
#define PAIRED_own(result, name, params, args, qualifier)
#define PAIRED_derived(result, name, params, args, qualifier)
#define PAIRED_groups(result, name, params, args, qualifier)
KVFORGE_CACHE_OPS(PAIRED_ROUTE)

}  // namespace kvforge
