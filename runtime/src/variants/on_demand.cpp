#include "kvforge/on_demand.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

#include "kvforge/cpu_level.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/variant_library.hpp"

extern char** environ;

namespace kvforge {
namespace {

// A scratch file that the child writes one of its streams into; removed when done.
struct CapturedStream {
  std::string path;
  int fd = -1;
  CapturedStream() {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp && *tmp ? tmp : "/tmp") + "/kvforge-on-demand-XXXXXX";
    fd = mkstemp(path.data());
    if (fd < 0) throw BackendError("on demand: cannot create a scratch file in " + path);
  }
  ~CapturedStream() {
    if (fd >= 0) close(fd);
    unlink(path.c_str());
  }
  std::vector<std::string> lines() const {
    std::ifstream in(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(line);
    return out;
  }
};

struct Finished {
  int status;
  std::vector<std::string> out, err;
};

// Runs `argv` with `pythonpath` in front of PYTHONPATH; waits for it.
Finished run(const std::vector<std::string>& argv, const std::string& pythonpath) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string(*e).rfind("PYTHONPATH=", 0) != 0) env_strings.emplace_back(*e);
  const char* old = std::getenv("PYTHONPATH");
  env_strings.push_back("PYTHONPATH=" + pythonpath + (old && *old ? ":" + std::string(old) : ""));
  std::vector<char*> envp, args;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  CapturedStream out, err;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out.fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err.fd, STDERR_FILENO);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0)
    throw BackendError("python: " + argv[0] + " cannot be run, so kvforge cannot build a variant on demand (" +
                       std::string(std::strerror(spawned)) + "); set OnDemandTools::python");
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out.lines(), err.lines()};
}

std::string joined(const std::vector<std::string>& lines, size_t from) {
  std::string m;
  for (size_t i = from; i < lines.size(); ++i) m += (m.empty() ? "" : "\n") + lines[i];
  return m;
}

}  // namespace

OnDemandVariant variant(const OnDemandRequest& request, const OnDemandTools& tools) {
  for (const auto& [argument, value] : {std::pair<const char*, const std::string*>{"layout", &request.layout},
                                        {"model", &request.model}, {"storage", &request.storage}})
    if (value->empty()) throw ArgumentError(argument, "is empty (a default's name or a spec file's path"
                                                      + std::string(argument[0] == 's' ? "; a dtype" : "") + ")");
  if (request.window < 0) throw OutOfRangeError("window", request.window, 0, std::numeric_limits<long long>::max());
  if (tools.python.empty() || tools.codegen.empty() || tools.include.empty() || tools.compiler.empty())
    throw BackendError("tools: OnDemandTools names no python, codegen, include or compiler: compile with "
                       "kvforge::runtime's compile definitions (CMake target_link_libraries), or fill them in");

  std::vector<std::string> argv = {tools.python, "-m", "kvforge_codegen", "build-variant", "--layout", request.layout,
                                   "--model", request.model, "--dtype", request.storage, "--include", tools.include,
                                   "--compiler", tools.compiler,
                                   // The library's CPU kernels: the level this process runs at, only.
                                   "--cpu-level", std::to_string(cpu_level())};
  if (!tools.specs.empty()) argv.insert(argv.end(), {"--specs", tools.specs});
  if (!request.input.empty()) argv.insert(argv.end(), {"--input", request.input});
  if (request.window > 0) argv.insert(argv.end(), {"--window", std::to_string(request.window)});
  if (!request.name.empty()) argv.insert(argv.end(), {"--name", request.name});
  if (!tools.device.empty()) argv.insert(argv.end(), {"--device", tools.device});
  for (const std::string& item : tools.link) argv.push_back("--link=" + item);
  // The library's own references to the runtime bind to its own copy, whatever the program exports.
  argv.push_back("--link=-Wl,-Bsymbolic");

  const Finished done = run(argv, tools.codegen);
  // kvforge-codegen build-variant: status 0 prints path, registry function, name; a refusal prints its
  // kind and argument on the first line of stderr, then the message (a spec's errors, one a line).
  if (done.status == 0 && done.out.size() == 3) {
    OnDemandVariant v;
    v.library = done.out[0];
    v.registry = &load_variants(done.out[0], done.out[1]);
    v.name = done.out[2];
    if (v.registry->find(v.name) == nullptr)
      throw BackendError(v.library + ": holds no variant " + v.name);
    return v;
  }
  const std::string head = done.err.empty() ? "" : done.err[0];
  const std::string argument = head.substr(head.find(' ') + 1);
  switch (done.status) {
    case 1:
      throw SpecError(std::vector<std::string>(done.err.begin() + (done.err.empty() ? 0 : 1), done.err.end()));
    case 3:
      throw ArgumentError(argument, joined(done.err, 1), ArgumentError::whole_message);
    case 4:
      throw UnsupportedError(joined(done.err, 1));
    case 5:
      throw BackendError(joined(done.err, 1));
    default:
      throw BackendError("on demand: " + tools.python + " -m kvforge_codegen build-variant exited with status " +
                         std::to_string(done.status) + ":\n" + joined(done.err, 0));
  }
}

}  // namespace kvforge
