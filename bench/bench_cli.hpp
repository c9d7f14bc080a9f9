// kvforge_bench's own flags (bench_cli.cpp): each is removed from argv once taken, so that Google
// Benchmark parses only its own.
#pragma once

#include <string>

namespace kvforge_bench {

// The value of `--name=value` (the last one given), else `fallback`.
std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback);
// Whether the switch `--name` was given.
bool take_switch(int& argc, char** argv, const std::string& name);
// Forks a child that spins on one core until this process exits (--kvf_busy_core).
void keep_a_core_busy();

}  // namespace kvforge_bench
