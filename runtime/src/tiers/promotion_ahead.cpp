#include "tiers/promotion_ahead.hpp"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace kvforge {

namespace {

// Calls run(first, count) for each run of packed pages that lie one after another in `from`.
template <class Run> void for_each_adjacent_run(const std::vector<const unsigned char*>& from, int64_t bytes, Run run) {
  for (size_t i = 0, n = from.size(); i < n;) {
    size_t end = i + 1;
    while (end < n && from[end] == from[end - 1] + bytes) ++end;
    run(i, end - i);
    i = end;
  }
}

// The CPU: a worker thread unpacks each queued copy, one unpack per run of adjacent host pages.
class ThreadPromotion final : public PromotionAhead {
 public:
  explicit ThreadPromotion(Cache& cache) : cache_(cache), worker_([this] { run(); }) {}
  ~ThreadPromotion() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }

  uint64_t queue(std::vector<const unsigned char*> from, std::vector<int32_t> pages) override {
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Copy{std::move(from), std::move(pages)});
      ticket = ++queued_;
    }
    changed_.notify_all();
    return ticket;
  }
  void order(uint64_t ticket) override { wait(ticket); }
  void wait(uint64_t ticket) override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return finished_ >= ticket || failure_; });
    if (failure_) std::rethrow_exception(failure_);
  }
  uint64_t finished() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_;
  }

 private:
  struct Copy {
    std::vector<const unsigned char*> from;
    std::vector<int32_t> pages;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return !queue_.empty() || stop_; });
      if (queue_.empty()) return;  // stopping, with every copy done
      Copy copy = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      try {
        for_each_adjacent_run(copy.from, cache_.packed_page_bytes(), [&](size_t i, size_t n) {
          cache_.unpack_pages(copy.from[i], IndexView{copy.pages.data() + i, DType::i32, Device::cpu, int64_t(n)});
        });
      } catch (...) {
        lock.lock();
        if (!failure_) failure_ = std::current_exception();
        lock.unlock();
      }
      lock.lock();
      ++finished_;
      changed_.notify_all();
    }
  }

  Cache& cache_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Copy> queue_;
  uint64_t queued_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread worker_;
};

// A GPU: each copy goes on a stream of the manager's, after what the cache's stream has queued so far
// (the pages it lands in may have just been packed for demotion there): one host-to-device copy per run
// of adjacent host pages into device staging, then one unpack launch. An event after it is what the
// cache's stream waits for. Staging is reused in the stream's order, so one buffer serves every copy.
class StreamPromotion final : public PromotionAhead {
 public:
  StreamPromotion(Cache& cache, Backend& backend) : cache_(cache), backend_(backend), stream_(backend.create_stream()) {}
  ~StreamPromotion() override {
    try {
      backend_.synchronize(stream_);
    } catch (...) {  // a failed device: nothing is left to wait for
    }
    for (const Copy& c : pending_) backend_.destroy_event(c.done);
    backend_.destroy_stream(stream_);
  }

  uint64_t queue(std::vector<const unsigned char*> from, std::vector<int32_t> pages) override {
    void* const main = cache_.config().stream;
    const int64_t bytes = cache_.packed_page_bytes(), n = int64_t(pages.size());
    void* const queued_there = backend_.record_event(main);
    backend_.wait_event(stream_, queued_there);
    backend_.destroy_event(queued_there);  // released once the wait is over
    if (staging_.bytes() < n * bytes || index_.bytes() < n * int64_t(sizeof(int32_t))) {
      backend_.synchronize(stream_);  // earlier copies still read the buffers being replaced
      if (staging_.bytes() < n * bytes) staging_ = Buffer(backend_, n * bytes);
      if (index_.bytes() < n * int64_t(sizeof(int32_t))) index_ = Buffer(backend_, std::max<int64_t>(256, n * 4));
    }
    auto* staged = staging_.as<unsigned char>();
    for_each_adjacent_run(from, bytes, [&](size_t i, size_t count) {
      backend_.from_host_queued(staged + int64_t(i) * bytes, from[i], int64_t(count) * bytes, stream_);
    });
    // The page list is pageable memory, copied out before the call returns; it is kept until done anyway.
    backend_.from_host_queued(index_.data(), pages.data(), n * int64_t(sizeof(int32_t)), stream_);
    cache_.set_stream(stream_);
    try {
      cache_.unpack_pages(staged, IndexView{index_.data(), DType::i32, cache_.config().device, n});
    } catch (...) {
      cache_.set_stream(main);
      throw;
    }
    cache_.set_stream(main);
    pending_.push_back(Copy{++queued_, backend_.record_event(stream_), std::move(pages)});
    return queued_;
  }
  void order(uint64_t ticket) override {
    if (ticket <= finished()) return;
    backend_.wait_event(cache_.config().stream, pending_[size_t(ticket - pending_.front().ticket)].done);
  }
  void wait(uint64_t ticket) override {
    if (ticket <= finished()) return;
    backend_.synchronize(stream_);
    finished();
  }
  uint64_t finished() override {
    while (!pending_.empty() && backend_.event_done(pending_.front().done)) {
      backend_.destroy_event(pending_.front().done);
      finished_ = pending_.front().ticket;
      pending_.pop_front();
    }
    return finished_;
  }

 private:
  struct Copy {
    uint64_t ticket;
    void* done;                  // recorded on stream_ after the copy's unpack
    std::vector<int32_t> pages;  // the page list its unpack reads
  };

  Cache& cache_;
  Backend& backend_;
  void* stream_;
  Buffer staging_, index_;
  std::deque<Copy> pending_;  // queued and not yet seen done, in ticket order
  uint64_t queued_ = 0, finished_ = 0;
};

}  // namespace

std::unique_ptr<PromotionAhead> PromotionAhead::start(Cache& cache, Backend& backend) {
  if (&backend.host() == &backend) return std::make_unique<ThreadPromotion>(cache);
  return std::make_unique<StreamPromotion>(cache, backend);
}

}  // namespace kvforge
