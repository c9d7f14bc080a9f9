// The widest x86-64 level this CPU and its operating system run, read from cpuid and XCR0. One source
// for the runtime (cpu_level.cpp) and for CMake's probe of the build machine (KVFORGE_CPU_LEVELS=native,
// cmake/cpu_level_probe.cpp), so that the two can never disagree.
#pragma once

#include <cpuid.h>

#include <cstdint>

namespace kvforge::detail {

inline bool cpuid_bit(uint32_t word, int b) { return (word >> b) & 1u; }

// XCR0: which register states the operating system saves on a context switch. A CPU with AVX-512
// whose OS does not save the zmm state must not run AVX-512 code.
inline uint64_t enabled_register_states() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// 2 (x86-64-v2), 3 (v3: AVX2) or 4 (v4: AVX-512 F, BW, CD, DQ, VL), with their register states enabled.
inline int detect_cpu_level() {
  uint32_t a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 2;
  const uint32_t leaf1_ecx = c;
  if (!cpuid_bit(leaf1_ecx, 27)) return 2;  // no OSXSAVE: the OS manages no AVX state
  const uint64_t xcr0 = enabled_register_states();
  uint32_t leaf7_ebx = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) leaf7_ebx = b;
  uint32_t ext_ecx = 0;
  if (__get_cpuid(0x80000001u, &a, &b, &c, &d)) ext_ecx = c;
  // x86-64-v3: AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE, with the ymm state enabled.
  const bool v3 = cpuid_bit(leaf1_ecx, 28) && cpuid_bit(leaf1_ecx, 12) && cpuid_bit(leaf1_ecx, 22) &&
                  cpuid_bit(leaf1_ecx, 29) && cpuid_bit(leaf7_ebx, 3) && cpuid_bit(leaf7_ebx, 5) &&
                  cpuid_bit(leaf7_ebx, 8) && cpuid_bit(ext_ecx, 5) && (xcr0 & 0x6) == 0x6;
  // x86-64-v4: AVX512 F, BW, CD, DQ and VL, with the opmask and zmm states enabled.
  const bool v4 = v3 && cpuid_bit(leaf7_ebx, 16) && cpuid_bit(leaf7_ebx, 17) && cpuid_bit(leaf7_ebx, 28) &&
                  cpuid_bit(leaf7_ebx, 30) && cpuid_bit(leaf7_ebx, 31) && (xcr0 & 0xe6) == 0xe6;
  return v4 ? 4 : v3 ? 3 : 2;
}

}  // namespace kvforge::detail
