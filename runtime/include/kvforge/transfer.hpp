// Moving one sequence's K/V between processes: from a prefill group of `sender_tp` ranks to a decode
// group of `receiver_tp` ranks, whatever the layout, page size, tensor-parallel degree or storage
// dtype on either side. See docs/transfer.md.
//
// Two wire formats; the receiver picks one per piece of heads (shard.hpp's shard_pieces) when it
// answers the sender's header:
// - Physical: where both caches are unquantized host caches of one storage dtype, the piece is all of
//   the receiver's heads, and the receiver's pages are dense blocks, the receiver describes its page
//   blocks as data (a Placement: page size, slot and head strides, where each page block sits) and
//   receives straight into its pool, one message per run of consecutive pages per layer. The sender
//   writes each layer into that order in one pass over its own pool. No layout knows another's.
// - Logical: otherwise, one message per layer of [heads, K|V, tokens, head_dim] values of the model's
//   input dtype. The sender reads it with its cache's own gather (dequantizing), the receiver writes
//   it with its cache's own append (quantizing on arrival). So every layout pair, every degree pair
//   and every dtype pair of one model works.
//
// Layers are pipelined: the sender reads layer l + 1 while layer l is in flight, and the receiver
// writes layer l (and says so, layers_ready()) while later layers are in flight, through a ring of
// staging buffers on each side. Both sides progress only when polled.
//
// A hybrid model's sequence also holds a state slot (StatePool: its linear layers' conv and recurrent
// states). A transfer may carry it: the sender reads the slot once the receivers have answered and
// sends each receiver its share in one message; the receiver takes its shares into host staging and
// writes its slot only when every layer has arrived, so a failed transfer leaves no state either. Both
// sides must hold the same model record (checked in the header). Between groups of other degrees, each
// part goes as its spec splits it (shard_axis: the slabs two ranks both hold; whole on every rank: from
// the sender of the receiver's first piece of heads).
//
// Every transfer starts with a header (TransferHeader) that the receiver checks against what it
// expects, and answers: accepted (with the wire format) or refused (naming the field). On any
// mismatch, a timeout, or a sender that stops, the receiver raises TransferError, and commits
// nothing: a paged sequence's pages go back to the pool and its id is unknown again, a row is reset.
// A refused sender raises TransferError naming the same field, and sends nothing more.
//
// Nothing a failed transfer leaves in flight is read by a later one, so an id can be used again at once:
// - A sender that gives up before every receiver answered (a timeout, a refusal, abandon()) follows its
//   header with a withdrawal of the same attempt. A receiver drops a header that a withdrawal already
//   follows, drops withdrawals, and drops headers of another request id whose tags are the same.
// - Answers carry the attempt they answer; a sender drops answers to its earlier attempts.
// - Layer messages carry an epoch in their tags that the receiver picks afresh for every transfer, so a
//   layer sent late for a failed transfer never lands in the next one.
// Each header is checked as it arrives, so a mismatch (a wrong `sender_tp`, say) is refused within one
// header round trip, without waiting for the other senders.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/cache.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/sequence_manager.hpp"
#include "kvforge/shard.hpp"
#include "kvforge/state_slots.hpp"
#include "kvforge/transport.hpp"

namespace kvforge {

// TransferError (errors.hpp): a transfer refused or left incomplete, nothing of it committed.

// The 64-bit hash of a sequence's token ids that both sides compute (FNV-1a over their bytes).
uint64_t token_hash(const std::vector<int32_t>& tokens);

// What travels first, from each sender to each receiver it feeds. Plain bytes, fixed size.
struct TransferHeader {
  uint32_t magic;
  uint32_t version;
  char layout[48];      // the sender's layout (for messages; any layout may feed any other)
  int32_t page_size;    // the sender's, 0 for contiguous
  uint8_t storage;      // the sender's storage DType
  uint8_t input;        // the wire's element DType (the model's input dtype): must match
  uint16_t flags;       // kCanWritePhysical: the sender can write the receiver's physical order
  int32_t model_heads;  // the full model's KV heads, layers and head_dim: must match
  int32_t layers;
  int32_t head_dim;
  int32_t sender_tp, sender_rank;
  int32_t head_begin, head_count;  // the heads this piece carries: must be what the receiver expects
  int32_t layer_begin, layer_count;
  int64_t tokens;      // must match
  int64_t request_id;  // must match
  uint64_t token_hash;  // must match
  uint64_t attempt;     // this send's own number: answers echo it, a withdrawal names it
  int64_t state_bytes;    // this piece's share of the state slot that follows the layers, 0 for none: must match
  uint64_t state_record;  // a hash of the model's state record, whatever the degree: must match
  // What a head's K and V halves mean, which head_dim alone cannot tell (VariantDescriptor::record_kind,
  // record_first, record_second): must match.
  int32_t record_kind, record_first, record_second;
};

// The state slot a sender sends beside a sequence's K/V: slot `slot` of `pool`.
struct StateSource {
  const StatePool* pool = nullptr;
  int64_t slot = -1;
};

// Staging buffers a side keeps between transfers, so a long-lived sender or receiver does not
// allocate (and fault in) its ring for every request.
struct Staging {
  Device on = Device::cpu;
  bool host = false;    // `device` is host memory paired with `on` (pinned for CUDA), never given a twin
  Buffer device, wire;  // wire: a host twin, where the transport cannot take the cache's device memory
  bool staged() const { return wire.data() != nullptr; }
  void* wire_data() const { return staged() ? wire.data() : device.data(); }
};

class StagingPool {
 public:
  // A buffer of at least `bytes` bytes of `device` memory (with a host twin where `transport` needs one).
  Staging take(Transport& transport, Device device, int64_t bytes);
  // A buffer of host memory that pairs with `device` (Backend::host(): pinned for CUDA), which the
  // transport takes as it is.
  Staging take_host(Transport& transport, Device device, int64_t bytes);
  void give(Staging s);  // keeps at most `keep` of them, the largest
  int keep = 8;

 private:
  std::vector<Staging> spare_;
};

// One side's view of a transfer's peers: the transport ranks of the other group, in tensor-parallel
// rank order, and that group's degree.
struct PeerGroup {
  std::vector<int> ranks;
  int tp() const { return int(ranks.size()); }
};

struct TransferOptions {
  int ring_layers = 4;  // staging buffers per side: layers in flight at once
  std::chrono::milliseconds timeout{30000};  // a receiver gives up after this long without progress
  bool physical = true;  // false: this side never uses the physical format (both sides must allow it)
  // The physical format through host staging on this side even where the transport reaches the pool:
  // the receiver takes each layer into a host buffer and copies its runs into the pool, and the sender
  // gathers each layer and writes the wire from a host copy. A device pool the transport cannot reach
  // always goes this way; on a host pool this runs that same path (the tests use it so).
  bool stage_physical = false;
};

// The prefill side. `cache` is this rank's shard (descriptor().tensor_parallel ranks in its group,
// this rank being `tp_rank`).
class KvSender {
 public:
  KvSender(Cache& cache, int tp_rank, Transport& transport, TransferOptions options = {});
  ~KvSender();
  // Starts sending positions [0, tokens.size()) of one sequence: `range` reads it (row, or page list
  // covering it, copied here; begin and end are set here). The sequence must stay unchanged until
  // the transfer is done. request_id: unique among transfers in flight between these groups (its low
  // bits tag the messages); receivers.ranks: ranks of the transport. Both are checked before anything
  // is posted. Nothing is read before the receivers answer: a range the cache cannot read raises from
  // poll(), and the transfer is then abandoned, its receiver timing out with nothing committed.
  // With `state`, that state slot goes too, and must stay unchanged until the transfer is done. Between
  // groups of a degree above 1 the pool must hold the variant's record, whose spec says how each part
  // splits, and a part whose spec gives each degree's shape goes only between groups of one degree
  // (ArgumentError "state").
  void send(int64_t request_id, const GatherRange& range, const std::vector<int32_t>& tokens, const PeerGroup& receivers,
            StateSource state = {});
  // Progress on every transfer; true when all are done (their buffers may then be reused). Raises
  // TransferError for a transfer its receiver refused (naming the receiver's field) or left
  // unanswered past the timeout, after dropping it; the others continue.
  bool poll();
  // Stops sending `request_id` (what is in flight still goes): the receiver times out and commits
  // nothing. For tests of a sender that dies midway.
  void abandon(int64_t request_id);
  // Messages posted so far (headers and layer messages), for the bench.
  int64_t messages() const { return messages_; }
  // Pieces sent in each wire format so far, for tests and the bench.
  int64_t physical_pieces() const { return physical_pieces_; }
  int64_t logical_pieces() const { return logical_pieces_; }

 private:
  struct Outgoing;
  bool progress(Outgoing& o);
  // The physical wire comes from a host copy of each gathered layer, not from the pool.
  bool staged_physical() const { return options_.stage_physical || cache_.config().device != Device::cpu; }
  void fail(int64_t request_id, const std::string& field, const std::string& message);
  Cache& cache_;
  int tp_rank_;
  Transport& transport_;
  TransferOptions options_;
  std::map<int64_t, std::unique_ptr<Outgoing>> outgoing_;
  std::vector<std::unique_ptr<Outgoing>> retired_;  // failed, with sends the transport may still read
  StagingPool spare_;
  int64_t messages_ = 0, physical_pieces_ = 0, logical_pieces_ = 0;
  uint64_t next_attempt_;
};

// The decode side.
class KvReceiver {
 public:
  KvReceiver(Cache& cache, int tp_rank, Transport& transport, TransferOptions options = {});
  ~KvReceiver();
  // Expects request `request_id` carrying `tokens` from the prefill group `senders`, into a paged
  // cache through `manager` as new sequence `seq` (allocated now, all or nothing), or into row `row`
  // of a contiguous or ring cache (manager null), which must be empty (row_length 0: StateError
  // otherwise). Every argument is checked before anything is allocated or posted.
  void expect(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders, SequenceManager* manager,
              int64_t seq_or_row);
  // The same for a hybrid model's sequence: its pages come from states.manager() and its state slot from
  // `states`, which the sender's state fills once every layer has arrived. A slot short raises
  // CapacityError("states") before anything is allocated; the pool's record is checked as send()'s
  // (ArgumentError "states"). A failed transfer gives back the pages and the slot (StateSlots::free).
  void expect(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders, StateSlots& states,
              int64_t seq);
  // Progress on every transfer. Raises TransferError for the first that failed (header mismatch,
  // timeout), after releasing what it held; the others continue.
  void poll();
  // Layers of `request_id` written into the cache so far (all of them: it is complete and committed).
  int layers_ready(int64_t request_id) const;
  bool done(int64_t request_id) const;
  // Forgets a completed transfer.
  void release(int64_t request_id);

 private:
  struct Incoming;
  void progress(Incoming& in);
  // The physical format lands in host buffers and is copied into the pool, not received into it.
  bool staged_physical() const {
    return options_.stage_physical || !transport_.takes_memory_of(cache_.config().device);
  }
  void begin(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders, SequenceManager* manager,
             int64_t seq_or_row, StateSlots* states);
  bool take_header(Incoming& in, size_t piece);
  bool state_landed(Incoming& in);
  void answer(Incoming& in, size_t piece, const char* refused_field);
  void fail(int64_t request_id, const std::string& field, const std::string& message);
  Cache& cache_;
  int tp_rank_;
  Transport& transport_;
  TransferOptions options_;
  std::map<int64_t, std::unique_ptr<Incoming>> incoming_;
  std::vector<std::unique_ptr<Incoming>> retired_;  // failed, with answers the transport may still read
  StagingPool spare_;
  int next_epoch_ = 0;  // the layer tags' epoch of the next transfer
  // Headers received while looking behind another (peer, tag -> them, in order), for a later expect().
  std::map<std::pair<int, int>, std::vector<TransferHeader>> early_;
};

}  // namespace kvforge
