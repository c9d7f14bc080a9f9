#include "kvforge/cpu_level.hpp"

#include <cpuid.h>
#include <unistd.h>

#include <omp.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "kvforge/errors.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge {
namespace {

bool bit(uint32_t word, int b) { return (word >> b) & 1u; }

// XCR0: which register states the operating system saves on a context switch. A CPU with AVX-512
// whose OS does not save the zmm state must not run AVX-512 code.
uint64_t enabled_register_states() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

int detect() {
  uint32_t a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kCpuBaseLevel;
  const uint32_t leaf1_ecx = c;
  if (!bit(leaf1_ecx, 27)) return kCpuBaseLevel;  // no OSXSAVE: the OS manages no AVX state
  const uint64_t xcr0 = enabled_register_states();
  uint32_t leaf7_ebx = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) leaf7_ebx = b;
  uint32_t ext_ecx = 0;
  if (__get_cpuid(0x80000001u, &a, &b, &c, &d)) ext_ecx = c;
  // x86-64-v3: AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE, with the ymm state enabled.
  const bool v3 = bit(leaf1_ecx, 28) && bit(leaf1_ecx, 12) && bit(leaf1_ecx, 22) && bit(leaf1_ecx, 29) &&
                  bit(leaf7_ebx, 3) && bit(leaf7_ebx, 5) && bit(leaf7_ebx, 8) && bit(ext_ecx, 5) && (xcr0 & 0x6) == 0x6;
  // x86-64-v4: AVX512 F, BW, CD, DQ and VL, with the opmask and zmm states enabled.
  const bool v4 = v3 && bit(leaf7_ebx, 16) && bit(leaf7_ebx, 17) && bit(leaf7_ebx, 28) && bit(leaf7_ebx, 30) &&
                  bit(leaf7_ebx, 31) && (xcr0 & 0xe6) == 0xe6;
  const int level = v4 ? 4 : v3 ? 3 : kCpuBaseLevel;
  return level < kCpuMaxLevel ? level : kCpuMaxLevel;
}

int chosen() {
  const int supported = cpu_level_supported();
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
}

}  // namespace

int cpu_level_supported() {
  static const int level = detect();
  return level;
}

int cpu_level() {
  // A build of the base level's kernels only (CMake's KVFORGE_CPU_BASE_ONLY) runs no other; it still
  // refuses a KVFORGE_CPU_LEVEL this CPU cannot run.
  static const int level = chosen();
#ifdef KVFORGE_CPU_BASE_ONLY
  (void)level;
  return kCpuBaseLevel;
#else
  return level;
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
