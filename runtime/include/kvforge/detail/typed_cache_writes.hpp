// TypedCache's writes (typed_cache.hpp declares the class): append, which checks its tokens and
// targets and writes them, or stages them in a lazy variant; and commit, which writes what is staged.
#pragma once

#include <algorithm>
#include <string>

#include "kvforge/detail/typed_cache.hpp"

namespace kvforge {

template <class Traits>
void TypedCache<Traits>::append(int layer, const TensorView& k, const TensorView& v, const TokenTargets& targets) {
  detail::check_layer(layer, layers());
  const int64_t tokens = k.shape[0];
  detail::check_tensor("k", k, {tokens, heads(), head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_tensor("v", v, {tokens, heads(), head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_targets_addressing(targets, addressing == Addressing::paged, tokens);
  if constexpr (addressing == Addressing::paged) {
    detail::check_index_view("targets.slots", targets.slots, DType::i64, tokens, config_.device, tokens);
  } else {
    detail::check_index_view("targets.rows", targets.rows, DType::i32, tokens, config_.device, tokens);
    detail::check_index_view("targets.positions", targets.positions, DType::i32, tokens, config_.device, tokens);
  }
  if constexpr (lazy) {
    if (staged_[layer] + tokens > staged_capacity_)
      throw OutOfRangeError("k.shape[0]", tokens, 0, staged_capacity_ - staged_[layer] + 1, -1,
                            "layer " + std::to_string(layer) + " already holds " + std::to_string(staged_[layer]) +
                                " of max_staged_tokens=" + std::to_string(staged_capacity_) +
                                " staged tokens; commit() first");
  }
  if (tokens == 0) return;
  detail::IndexChecks checks;
  if constexpr (addressing == Addressing::paged) {
    checks.add(index_check(targets.slots, tokens, 0, capacity_.pages * page_size(), true, detail::kCheckSlots));
  } else {
    checks.add(index_check(targets.rows, tokens, 0, capacity_.rows, true, detail::kCheckRows));
    // A ring's row length (int32) is its highest position + 1, so that position stays below INT32_MAX.
    const int64_t max_position = addressing == Addressing::ring ? INT32_MAX : capacity_.positions;
    checks.add(index_check(targets.positions, tokens, 0, max_position, true, detail::kCheckPositions));
  }

  if constexpr (lazy) {
    // One operation stages the tokens and their targets, after the targets' checks.
    const int64_t first = int64_t(layer) * staged_capacity_ + staged_[layer];
    const int64_t row_elems = int64_t(heads()) * head_dim();
    detail::StageArgs<input_t> s{detail::rows3<const input_t>(k), detail::rows3<const input_t>(v),
                                 stage_k_.as<input_t>() + first * row_elems,
                                 stage_v_.as<input_t>() + first * row_elems, tokens, status()};
    s.ext = extents();
    if constexpr (addressing == Addressing::paged) {
      s.targets = {static_cast<const int64_t*>(targets.slots.data), staged_slots() + first};
    } else {
      s.targets = {nullptr, nullptr, static_cast<const int32_t*>(targets.rows.data), staged_rows() + first,
                   static_cast<const int32_t*>(targets.positions.data), staged_positions() + first};
    }
    s.checks = checks;
    ops_->stage(launch(), s);
    staged_[layer] += tokens;
  } else {
    detail::WriteArgs<storage_t, input_t> a = write_args();
    a.k = detail::rows3<const input_t>(k);
    a.v = detail::rows3<const input_t>(v);
    a.rows = static_cast<const int32_t*>(targets.rows.data);
    a.positions = static_cast<const int32_t*>(targets.positions.data);
    a.slots = static_cast<const int64_t*>(targets.slots.data);
    a.tokens = tokens;
    a.first_layer = layer;
    a.num_layers = 1;
    a.checks = checks;
    ops_->write(launch_pool_writes(), a);
  }
}

template <class Traits> void TypedCache<Traits>::commit() {
  if constexpr (lazy) {
    // One launch covers every layer, over as many tokens as the fullest layer staged: entries past a
    // layer's own count hold target -1 and are skipped. The shape follows the step's token counts, as
    // an append's does, so a captured step replays with the same one. A decode step then skips the
    // padding of a staging sized for prefills (on an H200 the whole step did not change measurably:
    // bench/RESULTS.md, section 6).
    const int64_t staged = *std::max_element(staged_.begin(), staged_.end());
    if (staged == 0) return;
    const int64_t row_elems = int64_t(heads()) * head_dim();
    detail::WriteArgs<storage_t, input_t> a = write_args();
    a.k = {stage_k_.as<const input_t>(), row_elems, head_dim()};
    a.v = {stage_v_.as<const input_t>(), row_elems, head_dim()};
    a.input_layer_stride = staged_capacity_ * row_elems;
    if constexpr (addressing == Addressing::paged) {
      a.slots = staged_slots();
    } else {
      a.rows = staged_rows();
      a.positions = staged_positions();
    }
    a.target_layer_stride = staged_capacity_;
    a.tokens = staged;
    a.first_layer = 0;
    a.num_layers = layers();
    ops_->write(launch_pool_writes(), a);
    backend_->fill(stage_targets_.data(), 0xff, stage_targets_.bytes(), config_.stream);
    std::fill(staged_.begin(), staged_.end(), 0);
  }
}

}  // namespace kvforge
