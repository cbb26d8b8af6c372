// Helpers shared by the test suites.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

#include "loom/error.hpp"

namespace loom::test {

// ||a - b|| / ||b|| over the common length (the sizes must match), in double.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

// A fresh directory per test (named after it), removed afterwards.
struct TmpDir {
  std::filesystem::path path;
  explicit TmpDir(const std::string& prefix = "loom_test_") {
    static int n = 0;
    path = std::filesystem::temp_directory_path() /
           (prefix + std::to_string(::getpid()) + "_" + std::to_string(n++) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TmpDir() { std::filesystem::remove_all(path); }
  TmpDir(const TmpDir&) = delete;
  TmpDir& operator=(const TmpDir&) = delete;
  std::string str() const { return path.string(); }
};

#ifdef LOOM_BINARY_DIR
// <build>/test_tmp/<name>, emptied and made again: the output folder of a run
// a test reads back (left in place afterwards, to look at when a test fails).
inline std::filesystem::path temp_dir(const std::string& name) {
  std::filesystem::path d = std::filesystem::path(LOOM_BINARY_DIR) / "test_tmp" / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}
#endif

// Expects f() to throw a loom::Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected loom::Error";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
  }
}

}  // namespace loom::test
