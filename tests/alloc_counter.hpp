// Counting replacements of the global operator new and delete, for the suites
// that prove a hot path allocates nothing (the GEMM and attention wrappers run a
// few hundred times a step). Include this header from exactly one source file
// of a test executable: it defines the replacements, which then serve the whole
// process, the plugins loaded with dlopen included.
//
// Counting is off until AllocCounter::start() and off again at stop(). While on,
// every operator new and delete in the process (all threads) is counted and
// attributed by its call stack:
//   vendor: a frame lies in an NVIDIA library (libcudnn*, libcublas*, libcudart,
//           libcuda, libnvrtc, ...). Their internals are not ours to change:
//           cuDNN's backend, for one, creates a variant-pack descriptor in every
//           execute. Most of them link libstdc++ statically and are not seen at
//           all; cuDNN 9 links it dynamically, so its allocations land here.
//   ours:   everything else, i.e. the plugin, libloom, the frontend headers
//           compiled into a plugin, libstdc++ working on their behalf, the test.
// A test enables counting only around the calls it measures, with no gtest
// macro inside the window (they allocate).
#pragma once
#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <string>

namespace loom_test {

struct AllocCounts {
  int64_t ours_new = 0, ours_delete = 0;      // allocations and frees not made inside an NVIDIA library
  int64_t vendor_new = 0, vendor_delete = 0;  // those made inside one (reported, not ours to fix)
  std::string first_ours;  // the call stack of the first of ours (empty when there was none)
};

namespace alloc_detail {

inline std::atomic<bool> counting{false};
inline std::atomic<int64_t> ours_new{0}, ours_delete{0}, vendor_new{0}, vendor_delete{0};
constexpr int kFrames = 32;
inline void* first_frames[kFrames];
inline int first_depth = 0;
inline thread_local bool busy = false;  // backtrace/dladdr must not count themselves

inline bool vendor_pc(void* pc) {
  Dl_info info;
  if (dladdr(pc, &info) == 0 || info.dli_fname == nullptr) return false;
  const char* base = std::strrchr(info.dli_fname, '/');
  base = base ? base + 1 : info.dli_fname;
  static const char* const kVendor[] = {"libcudnn", "libcublas", "libcudart", "libcuda.", "libnvrtc", "libnvJitLink",
                                        "libnvidia", "libcupti"};
  for (const char* v : kVendor)
    if (std::strncmp(base, v, std::strlen(v)) == 0) return true;
  return false;
}

inline void record(bool is_new) {
  if (!counting.load(std::memory_order_relaxed) || busy) return;
  busy = true;
  void* frames[kFrames];
  const int n = backtrace(frames, kFrames);
  bool vendor = false;
  for (int i = 0; i < n && !vendor; ++i) vendor = vendor_pc(frames[i]);
  if (vendor) {
    (is_new ? vendor_new : vendor_delete).fetch_add(1);
  } else if ((is_new ? ours_new : ours_delete).fetch_add(1) == 0 && is_new) {
    std::memcpy(first_frames, frames, sizeof(void*) * static_cast<size_t>(n));
    first_depth = n;
  }
  busy = false;
}

inline void* allocate(std::size_t n, std::size_t align) {
  record(true);
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n ? n : 1);
  } else if (posix_memalign(&p, align, n ? n : 1) != 0) {
    p = nullptr;
  }
  return p;
}

inline void release(void* p) {
  if (p == nullptr) return;
  record(false);
  std::free(p);
}

}  // namespace alloc_detail

class AllocCounter {
 public:
  AllocCounter() {
    // backtrace() loads the unwinder on its first call: do that outside any window.
    void* f[2];
    backtrace(f, 2);
  }
  void start() {
    using namespace alloc_detail;
    ours_new = ours_delete = vendor_new = vendor_delete = 0;
    first_depth = 0;
    counting.store(true);
  }
  AllocCounts stop() {
    using namespace alloc_detail;
    counting.store(false);
    AllocCounts c;
    c.ours_new = ours_new.load(), c.ours_delete = ours_delete.load();
    c.vendor_new = vendor_new.load(), c.vendor_delete = vendor_delete.load();
    if (first_depth > 0) {
      std::ostringstream os;
      for (int i = 0; i < first_depth; ++i) {
        Dl_info info{};
        os << "\n    #" << i << " " << first_frames[i];
        if (dladdr(first_frames[i], &info) != 0) {
          if (info.dli_fname) os << " " << info.dli_fname;
          if (info.dli_sname)
            os << " (" << info.dli_sname << "+"
               << (static_cast<char*>(first_frames[i]) - static_cast<char*>(info.dli_saddr)) << ")";
        }
      }
      c.first_ours = os.str();
    }
    return c;
  }
};

}  // namespace loom_test

// The replacements ([replacement.functions]: not inline, one definition per program).
void* operator new(std::size_t n) {
  if (void* p = loom_test::alloc_detail::allocate(n, 0)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = loom_test::alloc_detail::allocate(n, 0)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al) {
  if (void* p = loom_test::alloc_detail::allocate(n, static_cast<std::size_t>(al))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t al) {
  if (void* p = loom_test::alloc_detail::allocate(n, static_cast<std::size_t>(al))) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return loom_test::alloc_detail::allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return loom_test::alloc_detail::allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return loom_test::alloc_detail::allocate(n, static_cast<std::size_t>(al));
}
void* operator new[](std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return loom_test::alloc_detail::allocate(n, static_cast<std::size_t>(al));
}
void operator delete(void* p) noexcept { loom_test::alloc_detail::release(p); }
void operator delete[](void* p) noexcept { loom_test::alloc_detail::release(p); }
void operator delete(void* p, std::size_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete[](void* p, std::size_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { loom_test::alloc_detail::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { loom_test::alloc_detail::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { loom_test::alloc_detail::release(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  loom_test::alloc_detail::release(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  loom_test::alloc_detail::release(p);
}
