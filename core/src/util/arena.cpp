#include "loom/arena.hpp"

#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

namespace loom {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::params: return "params";
    case MemCategory::master: return "master";
    case MemCategory::grads: return "grads";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::workspace: return "workspace";
    case MemCategory::comm: return "comm";
    case MemCategory::other: return "other";
  }
  return "?";
}

size_t ArenaPlan::add(std::string name, MemCategory cat, size_t bytes) {
  size_t offset = total_;
  size_t padded = (bytes + kAlign - 1) / kAlign * kAlign;
  blocks_.push_back({std::move(name), cat, offset, bytes});
  total_ += padded;
  return blocks_.size() - 1;
}

size_t ArenaPlan::category_bytes(MemCategory c) const {
  size_t b = 0;
  for (auto& blk : blocks_)
    if (blk.category == c) b += (blk.bytes + kAlign - 1) / kAlign * kAlign;
  return b;
}

std::string ArenaPlan::summary() const {
  std::ostringstream os;
  auto mib = [](size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  os << std::fixed << std::setprecision(2);
  for (int c = 0; c <= static_cast<int>(MemCategory::other); ++c) {
    size_t b = category_bytes(static_cast<MemCategory>(c));
    if (b == 0) continue;
    os << "  " << std::left << std::setw(12) << mem_category_name(static_cast<MemCategory>(c)) << std::right
       << std::setw(12) << mib(b) << " MiB\n";
  }
  os << "  " << std::left << std::setw(12) << "total" << std::right << std::setw(12) << mib(total_) << " MiB\n";
  return os.str();
}

Arena::~Arena() {
  if (base_ && device_ == Device::cpu) std::free(base_);
}

void Arena::allocate(const ArenaPlan& plan, Device device) {
  LOOM_CHECK(base_ == nullptr, "arena allocated twice");
  LOOM_CHECK(device == Device::cpu, "this arena build allocates host memory only; device=", device_name(device));
  plan_ = plan;
  device_ = device;
  bytes_ = plan.total_bytes() ? plan.total_bytes() : ArenaPlan::kAlign;
  base_ = std::aligned_alloc(ArenaPlan::kAlign, bytes_);
  if (!base_) throw Error(cat("out of host memory: the memory plan needs ", bytes_, " bytes"));
  std::memset(base_, 0, bytes_);
}

void* Arena::ptr(size_t block) const {
  LOOM_CHECK(block < plan_.blocks().size(), "arena block ", block, " out of range");
  return static_cast<char*>(base_) + plan_.blocks()[block].offset;
}

Tensor Arena::tensor(size_t block, DType t, std::initializer_list<int64_t> dims) const {
  Tensor x(ptr(block), t, device_, dims);
  LOOM_CHECK(x.bytes() <= plan_.blocks()[block].bytes, "tensor ", x.shape_str(), " larger than arena block '",
             plan_.blocks()[block].name, "'");
  return x;
}

}  // namespace loom
