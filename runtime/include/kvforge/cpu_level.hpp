// Which x86-64 level the CPU kernels run at. Every generated variant carries its CPU kernels built for
// each level from kCpuBaseLevel (x86-64-v2: SSE4.2) to kCpuMaxLevel (x86-64-v4: AVX-512), or, in a build
// of one level (CMake's KVFORGE_CPU_LEVELS), for that level only; the first cache created picks one
// table per variant for the life of the process.
#pragma once

#include <string>
#include <vector>

namespace kvforge {

// The widest level this CPU and its operating system support (AVX state enabled by the OS counts).
int cpu_level_supported();

// The level the kernels run at: the widest supported, or the lower one the environment variable
// KVFORGE_CPU_LEVEL asks for (a test or a comparison of widths). A value that is not a level, or one
// above what this CPU supports, throws UnsupportedError naming the allowed range. A build of one level
// runs that level: another asked for, or a CPU without it, throws UnsupportedError.
int cpu_level();

// The levels this build's CPU kernels exist for, narrowest first: every level from kCpuBaseLevel to
// kCpuMaxLevel, or the one a build of one level has (CMake's KVFORGE_CPU_LEVELS=<level> or native).
std::vector<int> cpu_levels_built();

// The size in bytes of the largest cache this CPU's first core has (sysfs; else sysconf; else 32 MiB).
long long cpu_last_level_cache_bytes();

// Whether a CPU pool of `pool_bytes` is written with non-temporal stores (op_table.hpp,
// Launch::stream_stores): when it is at least 8x cpu_last_level_cache_bytes(), so that its rows would
// be evicted before the next step reads them anyway. KVFORGE_CPU_STREAM_STORES=1 or 0 decides for
// every pool instead (an engine that knows its access pattern, or a test); another value throws
// UnsupportedError naming the allowed ones.
bool cpu_streams_pool(long long pool_bytes);

// The threads one CPU operation may use. 0, the default, is OpenMP's count (OMP_NUM_THREADS, else one
// a core); n >= 1 bounds it, as an engine bounds its intra-op pool when it runs threads of its own
// beside kvforge: under load, a thread whose core is busy only makes the others wait for it at the
// operation's end. KVFORGE_CPU_THREADS=n sets it at start. Negative values throw OutOfRangeError
// naming `threads`. Takes effect from the next operation, on every thread.
void set_cpu_threads(int threads);
// The bound in force, resolved: at least 1.
int cpu_threads();

// For reports: "x86-64-v4 (AVX-512)".
std::string cpu_level_name(int level);

}  // namespace kvforge
