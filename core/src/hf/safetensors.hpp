// safetensors (https://github.com/huggingface/safetensors) reader and writer.
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"k": "v"}}, then the data section; offsets are relative to
// the start of the data section.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/dtype.hpp"

namespace loom::hf {

// Scalar conversions used by the reader/writer (bf16: round to nearest even, NaN kept NaN).
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);

// Element size of a safetensors dtype name ("F32", "BF16", "I64", ...); 0 if unknown.
size_t safetensors_dtype_size(const std::string& dtype);

struct SafeTensorInfo {
  std::string name;
  std::string dtype;             // safetensors spelling: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL ...
  std::vector<int64_t> shape;
  int64_t numel = 0;
  size_t offset = 0;             // bytes from the start of the data section
  size_t nbytes = 0;
  std::string shape_str() const;
};

// A validated, memory-mapped safetensors file. Every entry is checked when the
// file is opened, so later reads cannot run outside the mapping.
class SafeTensorsFile {
 public:
  explicit SafeTensorsFile(const std::string& path);
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;
  SafeTensorsFile(SafeTensorsFile&& o) noexcept;
  SafeTensorsFile& operator=(SafeTensorsFile&&) = delete;
  ~SafeTensorsFile();

  const std::string& path() const { return path_; }
  // Tensor names in data order.
  const std::vector<std::string>& names() const { return order_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws naming the file and the tensor if absent.
  const SafeTensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's bytes as stored (little-endian).
  std::span<const std::byte> raw(const std::string& name) const;
  // Floating tensors (F64/F32/F16/BF16) converted to fp32; `numel` must match.
  void read_f32(const std::string& name, float* dst, int64_t numel) const;
  std::vector<float> read_f32(const std::string& name) const;
  // Integer tensors (I64/I32/I16/I8/U8/U16/U32/BOOL) widened to int64.
  std::vector<int64_t> read_i64(const std::string& name) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const std::byte* data_ = nullptr;  // start of the data section
  std::unordered_map<std::string, SafeTensorInfo> entries_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: `data` holds numel(shape) elements of `dtype`; it is
// stored as `out` (f32 -> f32/bf16 converts; otherwise out must equal dtype).
struct SafeTensorsEntry {
  std::string name;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  DType dtype = DType::f32;
  DType out = DType::f32;
};

// Writes a safetensors file crash-safely (tmp + fsync + rename). Entries are
// stored in the given order; names must be unique. Supported stored dtypes:
// f32, bf16, f16, f64, i32.
void write_safetensors(const std::string& path, const std::vector<SafeTensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace loom::hf
