// Memory is planned once and allocated once (docs/ARCHITECTURE.md "Memory").
// ArenaPlan collects named blocks by category; Arena allocates the total in one
// allocation and hands out pointers; nothing is allocated inside the step.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/dtype.hpp"
#include "loom/tensor.hpp"

namespace loom {

enum class MemCategory : uint8_t { params, master, grads, optimizer, activations, workspace, comm, other };
const char* mem_category_name(MemCategory c);

struct ArenaBlock {
  std::string name;
  MemCategory category;
  size_t offset;
  size_t bytes;
};

class ArenaPlan {
 public:
  static constexpr size_t kAlign = 256;  // enough for 16-byte vector loads and cuBLASLt
  // Returns the block index; the pointer is available after Arena::allocate.
  size_t add(std::string name, MemCategory cat, size_t bytes);
  size_t total_bytes() const { return total_; }
  size_t category_bytes(MemCategory c) const;
  const std::vector<ArenaBlock>& blocks() const { return blocks_; }
  // A table of bytes per category, for `loom check`.
  std::string summary() const;

 private:
  std::vector<ArenaBlock> blocks_;
  size_t total_ = 0;
};

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();
  // One allocation for the whole plan (host: aligned, zero-filled; cuda: later).
  void allocate(const ArenaPlan& plan, Device device);
  void* ptr(size_t block) const;
  Tensor tensor(size_t block, DType t, std::initializer_list<int64_t> dims) const;
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  const ArenaPlan& plan() const { return plan_; }

 private:
  ArenaPlan plan_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::cpu;
};

}  // namespace loom
