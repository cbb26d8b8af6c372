#include "train/plan_device.hpp"

#include "loom/error.hpp"

namespace loom {
namespace {

class PlannedBackend final : public Backend {
 public:
  PlannedBackend(Device device, PlannedDevice gpu, bool deterministic) : gpu_(std::move(gpu)) {
    ctx_.device = device;
    ctx_.deterministic = deterministic;
  }
  Device device() const override { return ctx_.device; }
  const ExecContext& ctx() const override { return ctx_; }
  // The whole card: nothing of it is taken yet (the process's own share is
  // planned apart, outside_arena_estimate).
  size_t device_memory_free() const override { return gpu_.total; }
  size_t device_memory_used() const override { return 0; }
  std::string device_name() const override { return gpu_.name; }

  // Every operation: a planned run computes nothing.
#define LOOM_PLANNED(sig, name) \
  sig override { refuse(name); }
  LOOM_PLANNED(void upload(Tensor&, const void*, size_t), "upload")
  LOOM_PLANNED(void download(void*, const Tensor&, size_t), "download")
  void* host_alloc(size_t) override { refuse("host_alloc"); }
  LOOM_PLANNED(void host_free(void*), "host_free")
  LOOM_PLANNED(void upload_async(Tensor&, const void*, size_t), "upload_async")
  LOOM_PLANNED(void zero(Tensor&), "zero")
  LOOM_PLANNED(void copy(Tensor&, const Tensor&), "copy")
  LOOM_PLANNED(void synchronize(), "synchronize")
  LOOM_PLANNED(void embedding_forward(Tensor&, const Tensor&, const Tensor&), "embedding_forward")
  LOOM_PLANNED(void embedding_backward(Tensor&, const Tensor&, const Tensor&), "embedding_backward")
  LOOM_PLANNED(void rmsnorm_forward(Tensor&, Tensor&, const Tensor&, const Tensor&, float), "rmsnorm_forward")
  LOOM_PLANNED(void rmsnorm_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&),
               "rmsnorm_backward")
  LOOM_PLANNED(void rope_forward(Tensor&, double), "rope_forward")
  LOOM_PLANNED(void rope_backward(Tensor&, double), "rope_backward")
  LOOM_PLANNED(void swiglu_forward(Tensor&, const Tensor&, const Tensor&), "swiglu_forward")
  LOOM_PLANNED(void swiglu_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&), "swiglu_backward")
  LOOM_PLANNED(void add(Tensor&, const Tensor&, const Tensor&), "add")
  LOOM_PLANNED(void accumulate(Tensor&, const Tensor&), "accumulate")
  LOOM_PLANNED(void cross_entropy(Tensor&, const Tensor&, Tensor&, float), "cross_entropy")
  double sum(const Tensor&) override { refuse("sum"); }
  double sq_norm(const Tensor&, int64_t, int64_t) override { refuse("sq_norm"); }
  LOOM_PLANNED(void sum_into(Tensor&, const Tensor&, int64_t, int64_t, bool), "sum_into")
  LOOM_PLANNED(void clip_scale(Tensor&, float, float), "clip_scale")
  LOOM_PLANNED(void scale(Tensor&, float), "scale")
  LOOM_PLANNED(void adamw(Tensor&, Tensor*, const Tensor&, Tensor&, Tensor&, const AdamWArgs&), "adamw")
  LOOM_PLANNED(void convert(Tensor&, const Tensor&), "convert")
  LOOM_PLANNED(void timer_start(), "timer_start")
  double timer_stop_ms() override { refuse("timer_stop_ms"); }
  LOOM_PLANNED(void timer_reserve(int), "timer_reserve")
  LOOM_PLANNED(void timer_mark(int), "timer_mark")
  double timer_elapsed_ms(int, int) override { refuse("timer_elapsed_ms"); }
  LOOM_PLANNED(void timestamp(Tensor&), "timestamp")
#undef LOOM_PLANNED

 private:
  [[noreturn]] void refuse(const char* op) const {
    throw Error(cat("internal: '", op, "' was called on the planned device (", gpu_.name,
                    "): a run planned without its GPU is laid out, never computed"));
  }

  PlannedDevice gpu_;
  ExecContext ctx_;
};

}  // namespace

std::unique_ptr<Backend> make_planned_backend(Device device, const PlannedDevice& gpu, bool deterministic) {
  return std::make_unique<PlannedBackend>(device, gpu, deterministic);
}

}  // namespace loom
