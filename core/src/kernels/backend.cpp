// The Backend's default MoE, FP8-operand (written or measured) and
// positioned-RoPE entry points: a backend without those kernels refuses at the
// first call, with one message (the CPU and CUDA backends override the MoE
// and RoPE ones, the CUDA backend the FP8 ones).
#include "loom/ops/backend.hpp"

#include "loom/error.hpp"
#include "loom/precision.hpp"

namespace loom {
namespace {

[[noreturn]] void no_moe(const Backend& b, const char* op) {
  throw Error(cat("the ", device_name(b.device()), " backend has no mixture-of-experts kernels in this build (", op,
                  "): model.ffn = \"moe\" runs on the CPU and CUDA backends"));
}

[[noreturn]] void no_fp8_operand(const Backend& b, const char* op) {
  throw Error(cat("the ", device_name(b.device()), " backend cannot write or measure an FP8 operand (", op,
                  "): a precision recipe offered one (Precision::fp8_operand, Fp8OperandAmax::operand_amax) on a "
                  "backend without those kernels; FP8 operands are written and measured on CUDA only, so the recipe "
                  "should decline them here"));
}

}  // namespace

void Backend::rope_forward_at(Tensor&, double, const Tensor&) {
  throw Error(cat("the ", ::loom::device_name(device()), " backend has no RoPE with given positions (rope_forward_at): "
                  "train.reset_position_ids runs on the CPU and CUDA backends"));
}
void Backend::rope_backward_at(Tensor&, double, const Tensor&) {
  throw Error(cat("the ", ::loom::device_name(device()), " backend has no RoPE with given positions (rope_backward_at): "
                  "train.reset_position_ids runs on the CPU and CUDA backends"));
}

void Backend::swiglu_forward_fp8(const Fp8Operand&, const Tensor&, const Tensor&) {
  no_fp8_operand(*this, "swiglu_forward_fp8");
}
void Backend::rmsnorm_forward_fp8(const Fp8Operand&, Tensor&, const Tensor&, const Tensor&, float) {
  no_fp8_operand(*this, "rmsnorm_forward_fp8");
}
void Backend::swiglu_backward_fp8(const Fp8Operand&, const Tensor&, const Tensor&, const Tensor&) {
  no_fp8_operand(*this, "swiglu_backward_fp8");
}

void Backend::rmsnorm_forward_amax(Tensor&, Tensor&, const Tensor&, const Tensor&, float, float*) {
  no_fp8_operand(*this, "rmsnorm_forward_amax");
}
void Backend::swiglu_forward_amax(Tensor&, const Tensor&, const Tensor&, float*) {
  no_fp8_operand(*this, "swiglu_forward_amax");
}
void Backend::swiglu_backward_amax(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, float*) {
  no_fp8_operand(*this, "swiglu_backward_amax");
}

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
