// A CUDA item's lanes on host threads, for tests of the CUDA code paths that reduce across lanes:
// EmulatedLanes runs one body per lane and meets them at every reduction, and EmulatedCudaExec is the
// executor whose lane_max and item_max those reductions are.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtest {

// The lanes of one CUDA item, emulated on host threads: each runs the same code with its own lane
// number, and they meet at every lane_max as a warp's lanes meet at a shuffle. A lane that skips a
// reduction the others reach (divergence, which a shuffle would not survive) fails the test rather
// than hanging it.
class EmulatedLanes {
 public:
  template <class F> static bool run(int lanes, F lane_body) {
    EmulatedLanes group(lanes);
    std::vector<std::thread> threads;
    for (int lane = 0; lane < lanes; ++lane)
      threads.emplace_back([&group, &lane_body, lane] {
        current() = &group;
        lane_id() = lane;
        lane_body(lane);
        group.leave();
      });
    for (std::thread& t : threads) t.join();
    return !group.diverged_;
  }
  // The maximum over the aligned group of `group_lanes` lanes this lane belongs to.
  static uint32_t group_max(int group_lanes, uint32_t value) {
    EmulatedLanes& g = *current();
    const int lane = lane_id();
    g.values_[size_t(lane)] = value;
    g.meet();
    uint32_t m = 0;
    for (int other = lane / group_lanes * group_lanes; other < (lane / group_lanes + 1) * group_lanes; ++other)
      m = std::max(m, g.values_[size_t(other)]);
    g.meet();
    return m;
  }

 private:
  explicit EmulatedLanes(int lanes) : lanes_(lanes), values_(size_t(lanes)) {}
  static EmulatedLanes*& current() {
    static thread_local EmulatedLanes* g = nullptr;
    return g;
  }
  static int& lane_id() {
    static thread_local int lane = 0;
    return lane;
  }
  // Every lane still running arrives before any goes on; a lane that finished counts as diverged.
  void meet() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == lanes_ - finished_) {
      arrived_ = 0;
      ++generation_;
      wake_.notify_all();
      return;
    }
    if (!wake_.wait_for(lock, std::chrono::seconds(10), [&] { return generation_ != generation; })) diverged_ = true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished_;
    if (arrived_ > 0) {
      diverged_ = true;  // some lanes wait at a reduction this lane never reached
      arrived_ = 0;
      ++generation_;
      wake_.notify_all();
    }
  }
  int lanes_, arrived_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool diverged_ = false;
  std::vector<uint32_t> values_;
  std::mutex mutex_;
  std::condition_variable wake_;
};

// The executor facts ops.hpp's quantized write reads, with lane_max over emulated lanes.
struct EmulatedCudaExec {
  static constexpr int kTileItems = 1;
  static constexpr bool kChunkedQuant = true;
  static constexpr bool kHoldsTokens = true;
  template <int Lanes, int Group = Lanes> static uint32_t lane_max(uint32_t value) {
    return EmulatedLanes::group_max(Group, value);
  }
  template <int Lanes> static uint32_t item_max(uint32_t value) { return EmulatedLanes::group_max(Lanes, value); }
  static constexpr int row_begin(int lane) { return lane; }
  static constexpr int row_step(int lanes) { return lanes; }
};

}  // namespace kvtest
