#include "kvforge/cpu_level.hpp"

#include <unistd.h>

#include <omp.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "kvforge/backends/cpu/cpu_detect.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge {
namespace {

int chosen() {
  const int supported = cpu_level_supported();
#ifdef KVFORGE_CPU_ONLY_LEVEL
  // A build of one level's kernels (CMake's KVFORGE_CPU_LEVELS=<level> or native) runs that level only:
  // a CPU without it must not run them, and no narrower level exists to ask for.
  constexpr int only = KVFORGE_CPU_ONLY_LEVEL;
  if (supported < only)
    throw UnsupportedError("this build's CPU kernels are " + cpu_level_name(only) + "'s only (CMake's "
                           "KVFORGE_CPU_LEVELS), and this CPU runs up to " + cpu_level_name(supported) +
                           ": build kvforge with -DKVFORGE_CPU_LEVELS=all (every level, the widest chosen at run "
                           "time) or native");
  const char* asked_only = std::getenv("KVFORGE_CPU_LEVEL");
  if (asked_only != nullptr && *asked_only != '\0' && std::string(asked_only) != std::to_string(only))
    throw UnsupportedError(std::string("KVFORGE_CPU_LEVEL=") + asked_only + ": not a level this build has (allowed: " +
                           std::to_string(only) + "; its CPU kernels are " + cpu_level_name(only) +
                           "'s only, CMake's KVFORGE_CPU_LEVELS; a build with -DKVFORGE_CPU_LEVELS=all has every "
                           "level)");
  return only;
#else
  const char* asked = std::getenv("KVFORGE_CPU_LEVEL");
  if (asked == nullptr || *asked == '\0') return supported;
  const std::string text = asked;
  const bool digit = text.size() == 1 && text[0] >= '0' && text[0] <= '9';
  const int level = digit ? text[0] - '0' : -1;
  if (level < kCpuBaseLevel || level > supported)
    throw UnsupportedError("KVFORGE_CPU_LEVEL=" + text + ": not a level this CPU can run (allowed: " +
                           std::to_string(kCpuBaseLevel) + ".." + std::to_string(supported) + ", " +
                           cpu_level_name(supported) + " is this CPU's widest)");
  return level;
#endif
}

}  // namespace

int cpu_level_supported() {
  static const int level = detail::detect_cpu_level();  // 2 to 4: kCpuBaseLevel to kCpuMaxLevel
  return level;
}

int cpu_level() {
  static const int level = chosen();
  return level;
}

std::vector<int> cpu_levels_built() {
#ifdef KVFORGE_CPU_ONLY_LEVEL
  return {KVFORGE_CPU_ONLY_LEVEL};
#else
  std::vector<int> levels;
  for (int level = kCpuBaseLevel; level <= kCpuMaxLevel; ++level) levels.push_back(level);
  return levels;
#endif
}

long long cpu_last_level_cache_bytes() {
  static const long long bytes = [] {
    // The cache this CPU's core shares, as sysfs describes it (the highest level listed). glibc's
    // sysconf reports the whole socket's L3 on some EPYC VMs (384 MiB where a core sees 32 MiB).
    long long found = 0;
    for (int index = 0; index < 8; ++index) {
      std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
      std::string text;
      if (!(f >> text) || text.empty()) continue;
      long long value = std::atoll(text.c_str());
      const char unit = text.back();
      value *= unit == 'K' ? 1024LL : unit == 'M' ? 1024LL * 1024 : 1LL;
      if (value > found) found = value;
    }
    if (found > 0) return found;
    const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return v > 0 ? (long long)v : 32LL << 20;
  }();
  return bytes;
}

bool cpu_streams_pool(long long pool_bytes) {
  static const int forced = [] {
    const char* asked = std::getenv("KVFORGE_CPU_STREAM_STORES");
    if (asked == nullptr || *asked == '\0') return -1;
    const std::string text = asked;
    if (text != "0" && text != "1")
      throw UnsupportedError("KVFORGE_CPU_STREAM_STORES=" + text +
                             ": not a choice (allowed: 1, stream every pool's writes; 0, none; unset, pools of 8x the "
                             "largest cache or more)");
    return text == "1" ? 1 : 0;
  }();
  return forced >= 0 ? forced == 1 : pool_bytes >= 8 * cpu_last_level_cache_bytes();
}

namespace {
// 0: OpenMP's own count.
std::atomic<int>& thread_bound() {
  static std::atomic<int> bound{[] {
    const char* asked = std::getenv("KVFORGE_CPU_THREADS");
    if (asked == nullptr || *asked == '\0') return 0;
    char* end = nullptr;
    const long n = std::strtol(asked, &end, 10);
    if (*end != '\0' || n < 0 || n > INT_MAX)
      throw UnsupportedError(std::string("KVFORGE_CPU_THREADS=") + asked +
                             ": not a thread count (allowed: 0, OpenMP's own count; 1 or more, at most that many)");
    return int(n);
  }()};
  return bound;
}
}  // namespace

void set_cpu_threads(int threads) {
  if (threads < 0) throw OutOfRangeError("threads", threads, 0, INT_MAX, -1, "0 is OpenMP's own count");
  thread_bound().store(threads, std::memory_order_relaxed);
}

int cpu_threads() {
  const int bound = thread_bound().load(std::memory_order_relaxed);
  const int available = omp_get_max_threads();
  return bound > 0 && bound < available ? bound : available;
}

std::string cpu_level_name(int level) {
  const char* isa = level >= 4 ? "AVX-512" : level == 3 ? "AVX2" : "SSE4.2";
  return "x86-64-v" + std::to_string(level) + " (" + isa + ")";
}

}  // namespace kvforge
