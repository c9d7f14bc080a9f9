// kvforge_bench's own command line, taken before Google Benchmark sees the rest, and its busy core.
#include "bench_cli.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvforge_bench {

std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback) {
  std::string value = fallback;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(name + "=", 0) == 0) {
      value = a.substr(name.size() + 1);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return value;
}

bool take_switch(int& argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i)
    if (argv[i] == name) {
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      return true;
    }
  return false;
}

// A child process that spins until this one exits (the kernel signals it then), as an engine's own
// threads or a neighbour would keep a core busy. Not pinned: the scheduler places it, as it would them.
void keep_a_core_busy() {
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    std::perror("kvforge_bench: fork for --kvf_busy_core");
    std::exit(2);
  }
  if (child > 0) return;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(0);
  volatile uint64_t spin = 0;
  for (;;) ++spin;
}

}  // namespace kvforge_bench
