// Prints the widest x86-64 level of the machine that runs it (KVFORGE_CPU_LEVELS=native's probe).
#include <cstdio>

#include "kvforge/backends/cpu/cpu_detect.hpp"

int main() { std::printf("%d\n", kvforge::detail::detect_cpu_level()); }
