// PyTorch's forms of a CUDA bench case's job (torch_peers.hpp: the CPU bench's forms, on the device),
// on the case's own pool, inputs, targets and outputs, timed as kvforge's eager calls are: each call
// moves to the next layer and, after all layers, to the next targets (and output slice). Torch runs on
// its current stream, the legacy default stream, so its calls are timed there.
// Part of kvforge_cuda_bench: cuda_bench.cu includes it once, inside its anonymous namespace, after
// Record and Inputs.
#pragma once

void time_torch_forms(Record& rec, const Cache& cache, const Shape& s, const Plan& p, const Inputs& in, Timer& timer) {
  const VariantDescriptor& d = cache.descriptor();
  rec.torch_note = torch_missing(Device::cuda);
  if (!rec.torch_note.empty()) return;
  std::vector<Targets> epochs;
  for (const Epoch& e : p.epochs) epochs.push_back(Targets{e.rows, e.positions, e.slots, e.row, 0});
  PeerSetup setup;
  setup.cache = &cache;
  check(cudaGetDevice(&setup.device_index), "cudaGetDevice");
  setup.gather = s.op == "gather";
  setup.epochs = &epochs;
  setup.count = s.n;
  setup.pages = p.pages.data();
  setup.pages_per_row = p.pages_per_seq;
  if (setup.gather) {  // the two output slices kvforge's gathers alternate between
    setup.k_out = in.k_out.data;
    setup.v_out = in.v_out.data;
    setup.out_slice_bytes = s.n * int64_t(d.heads) * d.head_dim * dtype_size(d.input);
    setup.out_slices = 2;
  } else {  // the first input set (kvforge's calls rotate through up to four)
    setup.k = in.k[0].data;
    setup.v = in.v[0].data;
    setup.tokens = p.tokens;
  }
  const std::vector<TorchForm> forms = torch_forms(setup);
  if (forms.empty()) rec.torch_note = "no torch form serves this job on this layout";
  const int L = d.layers;
  const cudaStream_t own = timer.stream;
  check(cudaDeviceSynchronize(), "before torch");
  for (TorchForm form : forms) {
    Timing t;
    try {
      const std::shared_ptr<TorchPeer> peer = make_torch_peer(setup, form);
      if (!peer) continue;
      timer.stream = nullptr;
      timer.eager([&](int i) {
        run_torch_peer(*peer, i % L, int64_t(i / L) % int64_t(epochs.size()), int64_t(i / L) % setup.out_slices);
      }, t);
    } catch (const std::exception& e) {  // a form this torch refuses: said, and the others still run
      rec.torch_note += std::string(rec.torch_note.empty() ? "" : "; ") + torch_form_name(form) + ": " + e.what();
    }
    timer.stream = own;
    check(cudaDeviceSynchronize(), "after torch");
    rec.torch.emplace_back(torch_form_name(form), t.eager_us);
  }
}
