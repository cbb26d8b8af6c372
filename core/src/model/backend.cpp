// The Backend's default MoE entry points: a backend without MoE kernels
// refuses at the first call, with one message (the CPU and CUDA backends
// override them).
#include "model/backend.hpp"

#include "loom/error.hpp"

namespace loom {
namespace {

[[noreturn]] void no_moe(const Backend& b, const char* op) {
  throw Error(cat("the ", device_name(b.device()), " backend has no mixture-of-experts kernels in this build (", op,
                  "): model.ffn = \"moe\" runs on the CPU and CUDA backends"));
}

}  // namespace

void Backend::moe_jitter(Tensor&, Tensor&, const Tensor&, double, uint64_t) { no_moe(*this, "moe_jitter"); }
void Backend::moe_route(MoeRouting&, const Tensor&, const Tensor&) { no_moe(*this, "moe_route"); }
void Backend::moe_gather(Tensor&, const Tensor&, const MoeRouting&) { no_moe(*this, "moe_gather"); }
void Backend::moe_combine(Tensor&, const Tensor&, const MoeRouting&) { no_moe(*this, "moe_combine"); }
void Backend::moe_combine_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const MoeRouting&) {
  no_moe(*this, "moe_combine_backward");
}
void Backend::moe_route_backward(Tensor&, Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const MoeRouting&, const Tensor*) {
  no_moe(*this, "moe_route_backward");
}
void Backend::moe_scatter_add(Tensor&, const Tensor&, const MoeRouting&, const Tensor*) {
  no_moe(*this, "moe_scatter_add");
}
void Backend::moe_aux_accumulate(Tensor&, const MoeRouting&) { no_moe(*this, "moe_aux_accumulate"); }
void Backend::moe_aux_finish(Tensor&, Tensor&, const Tensor&, double, double) { no_moe(*this, "moe_aux_finish"); }
void Backend::moe_read_counts(int64_t* host, const MoeRouting& r) {
  LOOM_CHECK(r.counts != nullptr && r.offsets == r.counts + r.E, "moe_read_counts: the routing's counts and offsets "
             "must be one [2E + 1] buffer (E = ", r.E, ")");
  const Tensor t(r.counts, DType::f64, device(), {2 * r.E + 1});  // 8-byte elements
  download(host, t, static_cast<size_t>(2 * r.E + 1) * sizeof(int64_t));
}

}  // namespace loom
