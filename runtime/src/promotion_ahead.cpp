#include "promotion_ahead.hpp"

#include <utility>

namespace kvforge {

PromotionAhead::PromotionAhead(Cache& cache) : cache_(cache), worker_([this] { run(); }) {}

PromotionAhead::~PromotionAhead() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

uint64_t PromotionAhead::queue(std::vector<const unsigned char*> from, std::vector<int32_t> pages) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Copy{std::move(from), std::move(pages)});
    ticket = ++queued_;
  }
  changed_.notify_all();
  return ticket;
}

void PromotionAhead::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return finished_ >= ticket || failure_; });
  if (failure_) std::rethrow_exception(failure_);
}

uint64_t PromotionAhead::finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

void PromotionAhead::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return !queue_.empty() || stop_; });
    if (queue_.empty()) return;  // stopping, with every copy done
    Copy copy = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    try {
      // One unpack per run of packed pages that lie one after another (a run of host pages).
      const int64_t bytes = cache_.packed_page_bytes();
      for (size_t i = 0, n = copy.pages.size(); i < n;) {
        size_t end = i + 1;
        while (end < n && copy.from[end] == copy.from[end - 1] + bytes) ++end;
        cache_.unpack_pages(copy.from[i], IndexView{copy.pages.data() + i, DType::i32, Device::cpu, int64_t(end - i)});
        i = end;
      }
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

}  // namespace kvforge
