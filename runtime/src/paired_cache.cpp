#include "kvforge/paired_cache.hpp"

#include <string>

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

void PairedCache::commit() {
  main_->commit();
  companion_->commit();
}

void PairedCache::reset() {
  main_->reset();
  companion_->reset();
}

void PairedCache::copy_blocks(const IndexView& pairs) {
  main_->copy_blocks(pairs);  // checks every pair first, so a refused call reaches neither
  companion_->copy_blocks(pairs);
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

void PairedCache::synchronize() {
  main_->synchronize();
  companion_->synchronize();
}

MemoryReport PairedCache::memory() const {
  MemoryReport a = main_->memory();
  const MemoryReport b = companion_->memory();
  a.storage_bytes += b.storage_bytes, a.scale_bytes += b.scale_bytes, a.staging_bytes += b.staging_bytes;
  a.bookkeeping_bytes += b.bookkeeping_bytes;
  return a;
}

void PairedCache::set_stream(void* stream) {
  main_->set_stream(stream);
  companion_->set_stream(stream);
}

void PairedCache::set_tuning(const Tuning& t) {
  main_->set_tuning(t);
  companion_->set_tuning(t);
}

}  // namespace kvforge
