// Element types and devices.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class DType : uint8_t { f32, bf16, f16, e4m3, e5m2, i32, u16, u32, f64 };
enum class Device : uint8_t { cpu, cuda };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::f32: case DType::i32: case DType::u32: return 4;
    case DType::bf16: case DType::f16: case DType::u16: return 2;
    case DType::e4m3: case DType::e5m2: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
    case DType::e4m3: return "fp8_e4m3";
    case DType::e5m2: return "fp8_e5m2";
    case DType::i32: return "int32";
    case DType::u16: return "uint16";
    case DType::u32: return "uint32";
    case DType::f64: return "fp64";
  }
  return "?";
}

constexpr std::string_view device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

}  // namespace loom
