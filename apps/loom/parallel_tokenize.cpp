#include "parallel_tokenize.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>

#include "loom/error.hpp"
#include "loom/log.hpp"
#include "util/terminal.hpp"

namespace loom::data {
namespace {
// Work is handed out in runs of consecutive documents of about this much text:
// small enough to balance the threads, large enough that the hand-out costs nothing.
constexpr uint64_t kChunkBytes = 256 << 10;
}  // namespace

ParallelTokenizer::ParallelTokenizer(const Tokenizer& tok, int threads, bool progress, uint64_t total_bytes)
    : tok_(tok),
      threads_(threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
      tty_(progress && interactive_terminal(STDERR_FILENO)),
      total_(total_bytes) {}

void ParallelTokenizer::draw(bool force) {
  if (!tty_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_draw_ < std::chrono::milliseconds(200)) return;
  last_draw_ = now;
  const double s = seconds_ + std::chrono::duration<double>(now - start_).count();
  const double mb = static_cast<double>(done_) / 1e6, total = static_cast<double>(total_) / 1e6;
  const double rate = s > 0 ? mb / s : 0;
  std::fprintf(stderr, "\r\033[2Ktokenizing  %.1f / %.1f MB  %.1f MB/s  %d thread%s", mb, total, rate, threads_,
               threads_ == 1 ? "" : "s");
  std::fflush(stderr);
}

void ParallelTokenizer::run(const std::vector<DocRef>& docs, std::vector<uint32_t>& train, std::vector<uint32_t>& val) {
  if (docs.empty()) return;
  start_ = std::chrono::steady_clock::now();
  // Chunks of consecutive documents; each gets its own output, joined in order.
  std::vector<std::size_t> first{0};
  uint64_t acc = 0;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    acc += docs[i].text.size();
    if (acc >= kChunkBytes && i + 1 < docs.size()) {
      first.push_back(i + 1);
      acc = 0;
    }
  }
  first.push_back(docs.size());
  const std::size_t chunks = first.size() - 1;
  std::vector<std::vector<uint32_t>> out_train(chunks), out_val(chunks);
  std::atomic<std::size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&](bool lead) {
    try {
      for (std::size_t c; (c = next.fetch_add(1)) < chunks;) {
        uint64_t b = 0;
        for (std::size_t i = first[c]; i < first[c + 1]; ++i) {
          try {
            tok_.encode_document(docs[i].text, docs[i].val ? out_val[c] : out_train[c]);
          } catch (const TokenizeInputError& e) {
            // The tokenizer named its file and the byte of the document; the
            // input file and the byte in it are known here.
            const DocRef& d = docs[i];
            if (d.file == nullptr) throw;
            throw Error(cat("input '", *d.file, "' at byte ", d.offset + e.offset,
                            d.repaired ? " (of its text after invalid UTF-8 was replaced by U+FFFD)" : "",
                            ", in the document that starts at byte ", d.offset, ": ", e.what()));
          }
          b += docs[i].text.size();
        }
        bytes += b;
        if (lead) {
          done_ = done_before_run_ + bytes.load();
          draw(false);
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(error_mu);
      if (!error) error = std::current_exception();
      next = chunks;  // the others stop at their next chunk
    }
  };
  const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads_), chunks));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work, false);
  work(true);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  for (std::size_t c = 0; c < chunks; ++c) {
    train.insert(train.end(), out_train[c].begin(), out_train[c].end());
    val.insert(val.end(), out_val[c].begin(), out_val[c].end());
  }
  done_before_run_ += bytes.load();
  done_ = done_before_run_;
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  start_ = std::chrono::steady_clock::now();
  draw(true);
}

double ParallelTokenizer::finish() {
  if (tty_) {
    std::fputs("\r\033[2K", stderr);
    std::fflush(stderr);
  }
  const double mb = static_cast<double>(done_) / 1e6;
  char line[160];
  std::snprintf(line, sizeof line, "prepare: tokenized %.1f MB with %s on %d thread(s) in %.2f s (%.1f MB/s)", mb,
                tok_.kind().c_str(), threads_, seconds_, seconds_ > 0 ? mb / seconds_ : 0.0);
  log_info(line);
  return seconds_;
}

}  // namespace loom::data
