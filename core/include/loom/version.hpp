// Versions. The library version follows the CMake project version (a test
// checks they agree); the plugin ABI version changes only with the plugin ABI.
#pragma once
// <version> defines the library's configuration macros (_GLIBCXX_USE_CXX11_ABI
// among them): without it LOOM_BUILD_ID would depend on what the including file
// happened to include first, and libloom's own id would read "cxx11abi-?".
#include <version>

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 1
#define LOOM_VERSION_PATCH 0

// Plugin ABI: the major changes when an interface breaks (a plugin built
// against another major is refused); the minor grows when the host adds
// something a plugin may use (a host accepts plugins with minor <= its own).
#define LOOM_ABI_MAJOR 10
#define LOOM_ABI_MINOR 3  // 10.3: loom::GatherCodecPlainUnits (sharding.hpp), an optional interface
                          //       beside GatherCodec: units without FP8 weights gathered as parameters
// 10.2: loom::Fp8OperandAmax and loom::Fp8RecastOperand (precision.hpp),
//       optional interfaces beside Precision; Backend::rmsnorm_forward_amax,
//       swiglu_forward_amax and swiglu_backward_amax (appended); an empty
//       Fp8Operand::q for rmsnorm_forward_fp8 and swiglu_forward_fp8
// 10.1: UnitState::grads_fresh (appended): a strategy's per-micro-batch gradient
//       buffer is written, not cleared and added to
// 10.0: Precision::gather_codec (the recipe supplies its FP8 weight gathers;
//       GatherCodecSetup, LinearWeight) replaces Precision::current_fp8_weight and
//       Fp8WeightCast; GatherCodec::state_bytes and bind (the vtables changed)
// 9.0: ExecContext::dnn_handle removed (the layout changed); the public ops
//      (loom/ops/: the cuBLASLt plan cache, FP8 casts) that precision plugins build on
// 8.3: document masking: loom::DocumentStarts (data.hpp), an optional interface beside
//      DataSource; AttentionShape::documents and ::spans (attention.hpp), appended
// 8.2: PluginInit::planning (a run planned without its device), LinearDesc::input_in_backward,
//      PrecisionSetup::params_sharded (setup() now comes after the strategy's plan)
// 8.1: loom::TokenScan (data.hpp), an optional interface beside DataSource: loom check scans tokens
// 8.0: Precision::fp8_operand (a new virtual), Fp8Operand: FP8 operands written by blocks
// 7.0: Precision::variable_row_multiple (a new virtual): MoE expert rows padded to it
// 6.0: Precision::current_fp8_weight, Sharding's GatherCodec (ShardingEnv::codec): FP8 weight gathers
// 5.0: Precision::keeps_wgrad_input (a new virtual: the vtable changed), PrecisionSetup::grad_accum
// 4.0: Precision setup, named state tensors, saved activations, LinearDesc::role; Communicator::all_to_all

#define LOOM_STR2_(x) #x
#define LOOM_STR_(x) LOOM_STR2_(x)

#if defined(__clang__)
#define LOOM_COMPILER_TAG "clang-" LOOM_STR_(__clang_major__)
#elif defined(__GNUC__)
#define LOOM_COMPILER_TAG "gcc-" LOOM_STR_(__GNUC__)
#else
#define LOOM_COMPILER_TAG "unknown"
#endif
#if defined(_GLIBCXX_USE_CXX11_ABI)
#define LOOM_CXXABI_TAG "cxx11abi-" LOOM_STR_(_GLIBCXX_USE_CXX11_ABI)
#else
#define LOOM_CXXABI_TAG "cxx11abi-?"
#endif

// "<compiler>-<major>;<C++ ABI>;loom-<major>.<minor>": plugins pass C++ objects
// across the boundary, so the host requires the same compiler family and major,
// the same C++ library ABI and the same libloom major.minor.
#define LOOM_BUILD_ID \
  LOOM_COMPILER_TAG ";" LOOM_CXXABI_TAG ";loom-" LOOM_STR_(LOOM_VERSION_MAJOR) "." LOOM_STR_(LOOM_VERSION_MINOR)

namespace loom {
const char* version_string();  // "0.1.0", from the library actually loaded
const char* build_id();        // LOOM_BUILD_ID as compiled into libloom
}  // namespace loom
