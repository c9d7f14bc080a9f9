// Which x86-64 level the CPU kernels run at. Every generated variant carries its CPU kernels built for
// each level from kCpuBaseLevel (x86-64-v2: SSE4.2) to kCpuMaxLevel (x86-64-v4: AVX-512); the first
// cache created picks one table per variant for the life of the process.
#pragma once

#include <string>

namespace kvforge {

// The widest level this CPU and its operating system support (AVX state enabled by the OS counts).
int cpu_level_supported();

// The level the kernels run at: the widest supported, or the lower one the environment variable
// KVFORGE_CPU_LEVEL asks for (a test or a comparison of widths). A value that is not a level, or one
// above what this CPU supports, throws UnsupportedError naming the allowed range.
int cpu_level();

// For reports: "x86-64-v4 (AVX-512)".
std::string cpu_level_name(int level);

}  // namespace kvforge
