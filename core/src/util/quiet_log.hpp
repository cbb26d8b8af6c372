// Errors only while a QuietLog lives: for work that would repeat its set-up
// lines many times (loom check planning a run again at other world sizes).
// The level before it comes back when it goes.
#pragma once

namespace loom {

class QuietLog {
 public:
  QuietLog();
  ~QuietLog();
  QuietLog(const QuietLog&) = delete;
  QuietLog& operator=(const QuietLog&) = delete;

 private:
  int saved_;  // spdlog's level, kept out of this header (util/log.cpp is the only file that includes spdlog)
};

}  // namespace loom
