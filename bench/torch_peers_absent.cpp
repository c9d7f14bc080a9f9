// Where PyTorch is not installed: no peer forms, and the report says so.
#include "torch_peers.hpp"

namespace kvforge_bench {

class TorchPeer {};

const char* torch_form_name(TorchForm) { return ""; }
std::string torch_version() { return ""; }
std::vector<TorchForm> torch_forms(const PeerSetup&) { return {}; }
std::string torch_missing(kvforge::Device) { return "this bench was built without PyTorch"; }
std::shared_ptr<TorchPeer> make_torch_peer(const PeerSetup&, TorchForm) { return nullptr; }
void run_torch_peer(TorchPeer&, int, int64_t, int64_t) {}

}  // namespace kvforge_bench
