// A cache and a companion over the same pages: DeepSeek-V3.2's sparse-attention indexer keeps a second
// per-token record (its index keys) beside the MLA latent, in pages the main cache's page table also
// names. Page p of the pair is page p of both, so one SequenceManager over the pair allocates, shares,
// copies on fork, offloads, tiers and frees the two together.
#pragma once

#include <memory>

#include "kvforge/cache.hpp"

namespace kvforge {

// Every call of the Cache interface goes to the main cache, except those that act on pages or on the
// whole cache, which go to both: reset, copy_blocks, commit, synchronize, set_stream and set_tuning;
// pack_pages and unpack_pages move page i as the main cache's packed page, then the companion's
// (packed_page_bytes() is their sum); memory() is the sum. The companion's own records are written and
// read through companion().
class PairedCache final : public Cache {
 public:
  // Both caches paged, of one page_size, one page count and one device; else ArgumentError naming
  // `companion`.
  PairedCache(std::unique_ptr<Cache> main, std::unique_ptr<Cache> companion);

  Cache& main() { return *main_; }
  Cache& companion() { return *companion_; }
  const Cache& companion() const { return *companion_; }

  const VariantDescriptor& descriptor() const override { return main_->descriptor(); }
  const CacheConfig& config() const override { return main_->config(); }
  const Geometry& geometry() const override { return main_->geometry(); }
  void append(int layer, const TensorView& k, const TensorView& v, const TokenTargets& targets) override {
    main_->append(layer, k, v, targets);
  }
  void commit() override;
  void gather(int layer, const GatherRange& range, const TensorView& k_out, const TensorView& v_out) override {
    main_->gather(layer, range, k_out, v_out);
  }
  void reset() override;
  void reset_row(int64_t row) override { main_->reset_row(row); }
  void reorder(const IndexView& beam) override { main_->reorder(beam); }
  void copy_blocks(const IndexView& pairs) override;
  LayerView view(int layer) const override { return main_->view(layer); }
  int64_t packed_page_bytes() const override { return main_->packed_page_bytes() + companion_->packed_page_bytes(); }
  void pack_pages(const IndexView& pages, void* packed) override;
  void unpack_pages(const void* packed, const IndexView& pages) override;
  void set_tensor_scale(int layer, float k_scale, float v_scale) override { main_->set_tensor_scale(layer, k_scale, v_scale); }
  int64_t row_length(int64_t row) const override { return main_->row_length(row); }
  void synchronize() override;
  MemoryReport memory() const override;
  const void* storage() const override { return main_->storage(); }
  const void* scale_storage() const override { return main_->scale_storage(); }
  const float* tensor_scale_storage() const override { return main_->tensor_scale_storage(); }
  void set_stream(void* stream) override;
  Tuning tuning() const override { return main_->tuning(); }
  void set_tuning(const Tuning& t) override;

 private:
  std::unique_ptr<Cache> main_, companion_;
};

}  // namespace kvforge
