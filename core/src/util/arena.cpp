#include "loom/arena.hpp"

#include "loom/error.hpp"

#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

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
  // No plan reaches 2^60 bytes (1 EiB) on any machine; refusing there keeps
  // the sums below (and every category's) far from wrapping around 2^64.
  constexpr size_t kMaxPlanBytes = size_t{1} << 60;
  if (bytes > kMaxPlanBytes || total_ + bytes > kMaxPlanBytes)
    throw Error(loom::cat("the memory plan grows beyond 1 EiB at '", name, "' (", bytes, " bytes, after ", total_,
                    " planned): no machine holds that; lower the model's sizes, train.micro_batch or train.seq_len"));
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
  if (!base_) return;
  if (device_ == Device::cpu) std::free(base_);
#ifdef LOOM_HAVE_CUDA
  // Errors are ignored: a destructor must not throw, and a dead context has
  // freed the memory already.
  else cudaFree(base_);
#endif
}

void Arena::allocate(const ArenaPlan& plan, Device device) {
  LOOM_CHECK(base_ == nullptr, "arena allocated twice");
  bytes_ = plan.total_bytes() ? plan.total_bytes() : ArenaPlan::kAlign;
  if (device == Device::cuda) {
#ifdef LOOM_HAVE_CUDA
    // One cudaMalloc for the whole plan (256-byte aligned, like kAlign), zeroed
    // like the host arena so that gradients and optimizer state start at 0.
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes_);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      throw Error(cat("cudaMalloc of the memory plan (", bytes_, " bytes) failed: ", cudaGetErrorString(err), "; ",
                      free_b, " of ", total_b, " device bytes are free. `loom check` prints the plan; a smaller "
                      "batch, recompute or more sharding needs less.\n", plan.summary()));
    }
    // cudaMemset runs on the legacy default stream, which does not order work
    // on the backend's non-blocking stream: wait for it before handing out
    // the memory.
    err = cudaMemset(p, 0, bytes_);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      cudaFree(p);
      throw Error(cat("cudaMemset of the ", bytes_, "-byte arena failed: ", cudaGetErrorString(err)));
    }
    plan_ = plan;
    device_ = device;
    base_ = p;
    return;
#else
    throw Error("this build of loom has no CUDA support: a device arena cannot be allocated");
#endif
  }
  plan_ = plan;
  device_ = device;
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
