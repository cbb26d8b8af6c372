// Tokenizing a batch of documents on every core for `loom prepare`, with the
// output in document order and a progress line (MB done, MB/s) on a terminal.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/ops/tokenizer.hpp"

namespace loom::data {

struct DocRef {
  std::string_view text;
  bool val = false;
  // For messages: the input file and the byte of it where the document
  // starts (in the text after invalid UTF-8 was replaced, when `repaired`).
  const std::string* file = nullptr;
  uint64_t offset = 0;
  bool repaired = false;
};

class ParallelTokenizer {
 public:
  // threads = 0: every core. progress: draw on stderr when it is a terminal.
  ParallelTokenizer(const Tokenizer& tok, int threads, bool progress, uint64_t total_bytes);
  // BOS + ids + EOS of each document, appended to `train` or `val` in the
  // order of `docs`. Rethrows the first error of any thread.
  void run(const std::vector<DocRef>& docs, std::vector<uint32_t>& train, std::vector<uint32_t>& val);
  // Clears the progress line, logs bytes, seconds and MB/s; returns the seconds spent in run().
  double finish();
  int threads() const { return threads_; }

 private:
  void draw(bool force);

  const Tokenizer& tok_;
  int threads_;
  bool tty_;
  uint64_t total_, done_ = 0, done_before_run_ = 0;
  double seconds_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace loom::data
