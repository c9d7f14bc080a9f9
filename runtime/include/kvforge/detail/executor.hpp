// The executor contract: what the one source of the operations (ops.hpp and the op files built on it)
// asks of a backend's executor. make_op_table checks it, so a new backend's executor that lacks a member
// fails to compile with that member named, not deep inside an operation. CpuExec (backends/cpu/exec_cpu.hpp)
// and CudaExec (backends/cuda/exec_cuda.cuh) are the two that exist; design.md says what each member means.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/op_table.hpp"

namespace kvforge::detail {

namespace contract {

struct Body {  // an item body as the operations write them: (item, lane, lanes)
  void operator()(int64_t, int, int) const {}
};

template <class E, class = void> struct for_each_item : std::false_type {};
template <class E>
struct for_each_item<E, std::void_t<decltype(std::declval<const E&>().for_each_item(
                            int64_t{}, Fixed<1>{}, int64_t{}, Body{}, std::declval<const IndexChecks&>()))>>
    : std::true_type {};
template <class E, class = void> struct from : std::false_type {};
template <class E>
struct from<E, std::void_t<decltype(E::from(std::declval<const Launch&>()))>>
    : std::is_same<decltype(E::from(std::declval<const Launch&>())), E> {};
template <class E, class = void> struct reductions : std::false_type {};
template <class E>
struct reductions<E, std::void_t<decltype(E::template lane_max<32>(0u)), decltype(E::template lane_max<32, 16>(0u)),
                                 decltype(E::template item_max<32>(0u))>> : std::true_type {};
template <class E, class = void> struct rows : std::false_type {};
template <class E>
struct rows<E, std::void_t<decltype(E::row_begin(0)), decltype(E::row_step(1))>> : std::true_type {};
template <class E, class = void> struct heads : std::false_type {};
template <class E>
struct heads<E, std::void_t<decltype(E::copy_heads(std::declval<float*>(), int64_t{}, std::declval<const float*>(),
                                                   int64_t{}, Fixed<2>{}, Fixed<8>{}, 0, 1)),
                            decltype(E::copy_heads_kv(TokenHeads<float>{}, TokenHeads<float>{},
                                                      TokenHeads<const float>{}, TokenHeads<const float>{}, Fixed<2>{},
                                                      Fixed<8>{}, 0, 1)),
                            decltype(E::zero_heads(std::declval<float*>(), int64_t{}, Fixed<2>{}, Fixed<8>{}, 0, 1))>>
    : std::true_type {};
template <class E, class = void> struct atomic_max : std::false_type {};
template <class E>
struct atomic_max<E, std::void_t<decltype(E::atomic_max(std::declval<int32_t*>(), int32_t{}))>> : std::true_type {};
template <class E, class = void> struct constants : std::false_type {};
template <class E>
struct constants<E, std::enable_if_t<std::is_convertible_v<decltype(E::kTileItems), int> &&
                                     std::is_same_v<std::remove_cv_t<decltype(E::kChunkedQuant)>, bool> &&
                                     std::is_same_v<std::remove_cv_t<decltype(E::kHoldsTokens)>, bool> &&
                                     std::is_convertible_v<decltype(E::kScannedRingTokens), int64_t>>>
    : std::true_type {};
template <class E, class = void> struct attend_tiles : std::false_type {};
template <class E>
struct attend_tiles<E, std::enable_if_t<(E::kAttendRows >= 1) && (E::kAttendBlock >= 1)>> : std::true_type {};
template <class E, class = void> struct tiles : std::bool_constant<E::kTileItems == 1> {};
template <class E>
struct tiles<E, std::void_t<decltype(E::tile_for(int64_t{}, 1)),
                            decltype(E::copy_row(std::declval<float*>(), std::declval<const float*>(), Fixed<8>{}))>>
    : std::true_type {};

}  // namespace contract

// Fails to compile, naming the member, where `Exec` is not an executor.
template <class Exec> constexpr bool check_executor() {
  static_assert(contract::for_each_item<Exec>::value,
                "executor: needs for_each_item(items, Fixed<lanes>, item_bytes, body(item, lane, lanes), checks), "
                "which runs body once per item and lane after the index checks");
  static_assert(contract::from<Exec>::value, "executor: needs static Exec from(const Launch&)");
  static_assert(contract::reductions<Exec>::value,
                "executor: needs static lane_max<Lanes, Group = Lanes>(uint32_t) and item_max<Lanes>(uint32_t)");
  static_assert(contract::rows<Exec>::value, "executor: needs static row_begin(lane) and row_step(lanes)");
  static_assert(contract::heads<Exec>::value,
                "executor: needs static copy_heads, copy_heads_kv and zero_heads over (heads, head_dim, lane, lanes)");
  static_assert(contract::atomic_max<Exec>::value, "executor: needs static atomic_max(int32_t*, int32_t)");
  static_assert(contract::constants<Exec>::value,
                "executor: needs constants kTileItems (int), kChunkedQuant and kHoldsTokens (bool), "
                "kScannedRingTokens (int64_t)");
  static_assert(contract::attend_tiles<Exec>::value,
                "executor: needs constants kAttendRows and kAttendBlock (>= 1): the query rows an attend item "
                "holds and the positions it decodes at once");
  static_assert(contract::tiles<Exec>::value,
                "executor: kTileItems > 1 (an item walks a tile of tokens) needs static tile_for(items, longest) "
                "and copy_row(dst, src, count), a whole row copied by one item");
  return true;
}

}  // namespace kvforge::detail
