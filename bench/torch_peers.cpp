// PyTorch's forms of the bench's jobs (torch_peers.hpp), on ATen, the C++ library under torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <array>

#include "torch_peers.hpp"

namespace kvforge_bench {

using namespace kvforge;

namespace {

at::ScalarType scalar_of(DType t) {
  switch (t) {
    case DType::f32: return at::kFloat;
    case DType::f16: return at::kHalf;
    case DType::bf16: return at::kBFloat16;
    case DType::i8: return at::kChar;
    case DType::f8e4m3: return at::kFloat8_e4m3fn;
    case DType::f8e5m2: return at::kFloat8_e5m2;
    default: return at::kLong;
  }
}

float qmax_of(DType t) { return t == DType::i8 ? 127.0f : t == DType::f8e4m3 ? 448.0f : 57344.0f; }

at::Device device_of(const PeerSetup& setup) {
  return setup.cache->config().device == Device::cuda ? at::Device(at::kCUDA, at::DeviceIndex(setup.device_index))
                                                      : at::Device(at::kCPU);
}

at::Tensor long_tensor(const std::vector<int64_t>& values, at::Device device) {
  return at::tensor(at::ArrayRef<int64_t>(values), at::TensorOptions().dtype(at::kLong)).to(device);
}

}  // namespace

class TorchPeer {
 public:
  TorchForm form;
  PeerSetup setup;
  VariantDescriptor d;
  std::vector<std::array<at::Tensor, 2>> pool;    // per layer, K and V: [units, slots, H, D] in place
  std::vector<std::array<at::Tensor, 2>> flat;    // index_copy on whole-page blocks: [units * slots, H, D]
  std::vector<std::array<at::Tensor, 2>> scales;  // quantized: [units, slots] (per token), [units, slots, H], or []
  at::Tensor k_in, v_in;                          // [T, H, D]
  struct Step {
    at::Tensor unit, slot, flat_slot, position, page_ids;
    int64_t row = 0, begin = 0, first_position = 0;
  };
  std::vector<Step> steps;
  std::vector<std::array<at::Tensor, 2>> out;  // per output slice: [H, count, D]

  bool quantized() const { return d.quant != Quant::none; }

  // JetStream's per-token quantization in torch ops: amax, divide, round, clamp, cast. Returns the
  // codes and the dynamic scales to store (undefined for a per-tensor scale, which is only read).
  std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int layer, int kv) const {
    const at::Tensor xf = x.to(at::kFloat);
    const float qmax = qmax_of(d.storage);
    at::Tensor scale, stored;
    if (d.quant == Quant::per_tensor) {
      scale = scales[size_t(layer)][size_t(kv)].to(at::kFloat);
    } else {
      const at::Tensor amax = d.quant == Quant::per_token ? xf.abs().amax({1, 2}, true) : xf.abs().amax({2}, true);
      scale = amax / qmax;
      scale = at::where(scale > 0, scale, at::ones_like(scale));
      stored = (d.quant == Quant::per_token ? scale.view({-1}) : scale.squeeze(-1)).to(scalar_of(d.scale));
    }
    at::Tensor q = xf / scale;
    q = d.storage == DType::i8 ? q.round().clamp(-qmax, qmax) : q.clamp(-qmax, qmax);
    return {q.to(scalar_of(d.storage)), stored};
  }

  // Codes as the input dtype: code * scale, with the scales gathered like the codes.
  at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale) const {
    at::Tensor s = scale.to(at::kFloat);
    if (d.quant == Quant::per_token) s = s.unsqueeze(-1).unsqueeze(-1);
    if (d.quant == Quant::per_token_head) s = s.unsqueeze(-1);
    return (codes.to(at::kFloat) * s).to(scalar_of(d.input));
  }

  void append(int layer, const Step& st) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& x = kv ? v_in : k_in;
      at::Tensor& cache = pool[size_t(layer)][size_t(kv)];
      if (quantized()) {
        auto [codes, stored] = quantize(x, layer, kv);
        cache.index_put_({st.unit, st.slot}, codes);
        if (stored.defined()) scales[size_t(layer)][size_t(kv)].index_put_({st.unit, st.slot}, stored);
      } else if (form == TorchForm::index_put) {
        cache.index_put_({st.unit, st.slot}, x);
      } else if (form == TorchForm::index_copy && d.paged()) {
        flat[size_t(layer)][size_t(kv)].index_copy_(0, st.flat_slot, x);
      } else if (form == TorchForm::index_copy) {  // HF StaticCache: [B, H, S, D].index_copy_(2, pos, k)
        const at::Tensor bhsd = cache.permute({0, 2, 1, 3});
        if (st.row < 0) {  // a decode step: every row at one position, B = the batch
          bhsd.index_copy_(2, st.position, x.unsqueeze(2));
        } else {
          bhsd.select(0, st.row).index_copy_(1, st.position, x.transpose(0, 1));
        }
      } else {  // DeepSpeed's static cache: a slice of positions, copy_
        if (st.row < 0) {
          cache.select(1, st.first_position).copy_(x);
        } else {
          cache.select(0, st.row).narrow(0, st.first_position, setup.tokens).copy_(x);
        }
      }
    }
  }

  void gather(int layer, const Step& st, int64_t slice) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& cache = pool[size_t(layer)][size_t(kv)];
      at::Tensor& o = out[size_t(slice)][size_t(kv)];
      at::Tensor codes, scale;
      if (form == TorchForm::slice_copy) {
        codes = cache.select(0, st.row).narrow(0, st.begin, setup.count);
        if (quantized() && d.quant != Quant::per_tensor)
          scale = scales[size_t(layer)][size_t(kv)].select(0, st.row).narrow(0, st.begin, setup.count);
      } else {  // index_select of the sequence's pages, then the range within them
        const int64_t P = d.page_size, within = st.begin % P;
        codes = cache.index_select(0, st.page_ids).flatten(0, 1).narrow(0, within, setup.count);
        if (quantized() && d.quant != Quant::per_tensor)
          scale = scales[size_t(layer)][size_t(kv)].index_select(0, st.page_ids).flatten(0, 1).narrow(0, within,
                                                                                                    setup.count);
      }
      if (quantized() && d.quant == Quant::per_tensor) scale = scales[size_t(layer)][size_t(kv)];
      o.copy_((quantized() ? dequantize(codes, scale) : codes).permute({1, 0, 2}));
    }
  }
};

const char* torch_form_name(TorchForm f) {
  switch (f) {
    case TorchForm::index_put: return "index_put";
    case TorchForm::index_copy: return "index_copy";
    case TorchForm::slice_copy: return "slice_copy";
    case TorchForm::index_select: return "index_select";
  }
  return "";
}

std::string torch_version() { return KVFORGE_TORCH_VERSION; }

std::string torch_missing(Device device) {
  if (device == Device::cuda && !at::hasCUDA())
    return "PyTorch " + torch_version() + " here has no CUDA (libtorch_cuda was not loaded, or sees no device)";
  return "";
}

std::vector<TorchForm> torch_forms(const PeerSetup& setup) {
  if (!torch_missing(setup.cache->config().device).empty()) return {};
  const VariantDescriptor& d = setup.cache->descriptor();
  // A lazy step stages and commits every layer; its eager twin stands for it beside torch.
  // Records of named parts have no torch form either: their bytes are codes, scales and values.
  if (d.update == UpdateMode::lazy || d.is_hybrid() || d.addressing == Addressing::ring || d.coded_records()) return {};
  if (setup.gather) return {d.paged() ? TorchForm::index_select : TorchForm::slice_copy};
  // The torch form quantizes per tensor, token or head; group scales and 4-bit codes have no form here.
  if (d.quant == Quant::per_group || dtype_values(d.storage) > 1) return {};
  if (d.quantized()) return {TorchForm::index_put};
  const LayerView lv = setup.cache->view(0);
  const bool whole_pages = d.paged() && lv.strides.row_or_page == lv.seq_or_slots * lv.strides.seq_or_slot &&
                           lv.strides.seq_or_slot == int64_t(lv.heads) * lv.head_dim &&
                           lv.strides.head == lv.head_dim;
  std::vector<TorchForm> forms = {TorchForm::index_put};
  if (whole_pages || !d.paged()) forms.push_back(TorchForm::index_copy);
  if (!d.paged()) forms.push_back(TorchForm::slice_copy);
  return forms;
}

std::shared_ptr<TorchPeer> make_torch_peer(const PeerSetup& setup, TorchForm form) {
  bool serves = false;
  for (TorchForm f : torch_forms(setup)) serves = serves || f == form;
  if (!serves) return nullptr;
  const at::Device device = device_of(setup);
  if (device.is_cpu()) at::set_num_threads(kvforge::cpu_threads());  // as many threads as kvforge's operations use
  auto p = std::make_shared<TorchPeer>();
  p->form = form;
  p->setup = setup;
  p->d = setup.cache->descriptor();
  const VariantDescriptor& d = p->d;
  const at::TensorOptions in_opts = at::TensorOptions().dtype(scalar_of(d.input)).device(device);
  for (int layer = 0; layer < d.layers; ++layer) {
    const LayerView lv = setup.cache->view(layer);
    std::array<at::Tensor, 2> views, flats, scale_views;
    for (int kv = 0; kv < 2; ++kv) {
      void* base = const_cast<void*>(kv ? lv.v : lv.k);
      views[size_t(kv)] = at::from_blob(base, {lv.rows_or_pages, lv.seq_or_slots, lv.heads, lv.head_dim},
                                        {lv.strides.row_or_page, lv.strides.seq_or_slot, lv.strides.head, 1},
                                        at::TensorOptions().dtype(scalar_of(lv.dtype)).device(device));
      if (form == TorchForm::index_copy && d.paged())
        flats[size_t(kv)] = views[size_t(kv)].view({lv.rows_or_pages * lv.seq_or_slots, lv.heads, lv.head_dim});
      if (lv.quant != Quant::none) {
        void* sbase = const_cast<void*>(kv ? lv.v_scales : lv.k_scales);
        const at::TensorOptions so = at::TensorOptions().dtype(scalar_of(lv.scale_dtype)).device(device);
        const Strides& ss = lv.scale_strides;
        if (lv.quant == Quant::per_tensor) {
          scale_views[size_t(kv)] = at::from_blob(sbase, {}, so);
        } else if (lv.quant == Quant::per_token) {
          scale_views[size_t(kv)] =
              at::from_blob(sbase, {lv.rows_or_pages, lv.seq_or_slots}, {ss.row_or_page, ss.seq_or_slot}, so);
        } else {
          scale_views[size_t(kv)] = at::from_blob(sbase, {lv.rows_or_pages, lv.seq_or_slots, lv.heads},
                                                  {ss.row_or_page, ss.seq_or_slot, ss.head}, so);
        }
      }
    }
    p->pool.push_back(views);
    p->flat.push_back(flats);
    p->scales.push_back(scale_views);
  }
  const int64_t H = d.heads, D = d.head_dim, P = d.page_size;
  if (!setup.gather) {
    p->k_in = at::from_blob(const_cast<void*>(setup.k), {setup.tokens, H, D}, in_opts);
    p->v_in = at::from_blob(const_cast<void*>(setup.v), {setup.tokens, H, D}, in_opts);
  }
  for (const Targets& t : *setup.epochs) {
    TorchPeer::Step st;
    if (setup.gather) {
      st.row = t.row;
      st.begin = t.begin;
      if (d.paged()) {
        std::vector<int64_t> ids;
        for (int64_t page = t.begin / P; page * P < t.begin + setup.count; ++page)
          ids.push_back(setup.pages[t.row * setup.pages_per_row + page]);
        st.page_ids = long_tensor(ids, device);
      }
    } else {
      std::vector<int64_t> unit, slot, position;
      for (size_t i = 0; i < t.rows.size(); ++i) {
        if (d.paged()) {
          unit.push_back(t.slots[i] / P);
          slot.push_back(t.slots[i] % P);
        } else {
          unit.push_back(t.rows[i]);
          slot.push_back(t.positions[i]);
        }
        position.push_back(t.positions[i]);
      }
      st.unit = long_tensor(unit, device);
      st.slot = long_tensor(slot, device);
      if (d.paged()) st.flat_slot = long_tensor(t.slots, device);
      // One token for each row at one position (decode), or consecutive positions of one row.
      const bool one_per_row = t.rows.size() > 1 && t.rows[0] != t.rows[1];
      st.row = one_per_row ? -1 : t.rows.empty() ? 0 : t.rows[0];
      st.first_position = t.positions.empty() ? 0 : t.positions[0];
      st.position = one_per_row ? long_tensor({st.first_position}, device) : long_tensor(position, device);
    }
    p->steps.push_back(st);
  }
  for (int64_t s = 0; s < setup.out_slices && setup.gather; ++s) {
    auto* k = static_cast<unsigned char*>(setup.k_out) + s * setup.out_slice_bytes;
    auto* v = static_cast<unsigned char*>(setup.v_out) + s * setup.out_slice_bytes;
    p->out.push_back({at::from_blob(k, {H, setup.count, D}, in_opts), at::from_blob(v, {H, setup.count, D}, in_opts)});
  }
  return p;
}

void run_torch_peer(TorchPeer& peer, int layer, int64_t epoch, int64_t out_slice) {
  const TorchPeer::Step& st = peer.steps[size_t(epoch)];
  if (peer.setup.gather) {
    peer.gather(layer, st, out_slice);
  } else {
    peer.append(layer, st);
  }
}

}  // namespace kvforge_bench
