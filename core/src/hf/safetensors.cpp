#include "hf/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/file_util.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom::hf {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts would need byte swaps");

namespace {

// The reference implementation refuses headers above 100 MB; a length beyond
// that is a corrupt or foreign file, and refusing early avoids a huge parse.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

const std::map<std::string, size_t>& dtype_sizes() {
  static const std::map<std::string, size_t> m = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},      {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2},  {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  return m;
}

std::string known_dtypes() {
  std::string s;
  for (auto& [k, v] : dtype_sizes()) s += (s.empty() ? "" : ", ") + k;
  return s;
}

std::string st_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    default: return "";
  }
}

std::string shape_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  return std::bit_cast<float>(u);
}

uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  // Keep NaN a NaN: rounding could carry a NaN payload into infinity.
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even (as torch does)
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: value = man * 2^-24
      float v = std::ldexp(static_cast<float>(man), -24);
      return sign ? -v : v;
    }
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  return std::bit_cast<float>(u);
}

size_t safetensors_dtype_size(const std::string& dtype) {
  auto it = dtype_sizes().find(dtype);
  return it == dtype_sizes().end() ? 0 : it->second;
}

std::string SafeTensorInfo::shape_str() const { return shape_string(shape); }

SafeTensorsFile::SafeTensorsFile(const std::string& path) : path_(path) {
  auto bad = [&](const std::string& what) {
    return Error(cat(path, ": not a valid safetensors file: ", what,
                     "; the file is corrupt or truncated — re-download or re-export it"));
  };
  int fd = open_regular_file(path, "safetensors file");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(cat("cannot stat ", path, ": ", std::strerror(errno)));
  }
  const size_t fsize = static_cast<size_t>(st.st_size);
  if (fsize < 8) {
    ::close(fd);
    throw bad(cat("file is ", fsize, " bytes, shorter than the 8-byte header length"));
  }
  void* m = ::mmap(nullptr, fsize, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file referenced
  if (m == MAP_FAILED) throw Error(cat("cannot mmap ", path, ": ", std::strerror(errno)));
  map_ = m;
  map_bytes_ = fsize;
  try {
    const auto* base = static_cast<const std::byte*>(map_);
    uint64_t hlen = 0;
    std::memcpy(&hlen, base, 8);
    if (hlen == 0 || hlen > kMaxHeaderBytes || hlen > fsize - 8)
      throw bad(cat("header length ", hlen, " is impossible for a file of ", fsize, " bytes (at most ",
                    std::min<uint64_t>(kMaxHeaderBytes, fsize - 8), ")"));
    const char* hdr = reinterpret_cast<const char*>(base + 8);
    if (hdr[0] != '{') throw bad("the JSON header does not start with '{'");
    nlohmann::json j;
    // A name twice would leave one of its entries unread (the parser keeps the
    // last): which of them holds the tensor cannot be told.
    std::set<std::string> names;
    std::string twice;
    auto note_names = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && twice.empty() &&
          !names.insert(parsed.get<std::string>()).second)
        twice = parsed.get<std::string>();
      return true;
    };
    try {
      j = nlohmann::json::parse(hdr, hdr + hlen, note_names);
    } catch (const nlohmann::json::exception& e) {
      throw bad(cat("the JSON header does not parse (", e.what(), ")"));
    }
    if (!twice.empty())
      throw bad(cat("the header names '", twice, "' twice; which entry holds the tensor cannot be told"));
    if (!j.is_object()) throw bad("the JSON header is not an object");
    data_ = base + 8 + hlen;
    const size_t data_bytes = fsize - 8 - hlen;
    std::vector<std::pair<size_t, std::string>> by_offset;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& name = it.key();
      const auto& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) throw bad("__metadata__ is not an object of strings");
        for (auto m2 = v.begin(); m2 != v.end(); ++m2) {
          if (!m2.value().is_string()) throw bad(cat("__metadata__ value for '", m2.key(), "' is not a string"));
          metadata_[m2.key()] = m2.value().get<std::string>();
        }
        continue;
      }
      auto tbad = [&](const std::string& what) { return bad(cat("tensor '", name, "': ", what)); };
      if (!v.is_object()) throw tbad("entry is not an object");
      if (!v.contains("dtype") || !v["dtype"].is_string()) throw tbad("missing \"dtype\"");
      if (!v.contains("shape") || !v["shape"].is_array()) throw tbad("missing \"shape\"");
      if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
        throw tbad("\"data_offsets\" must be [begin, end]");
      SafeTensorInfo info;
      info.name = name;
      info.dtype = v["dtype"].get<std::string>();
      size_t esize = safetensors_dtype_size(info.dtype);
      if (esize == 0) throw tbad(cat("unknown dtype \"", info.dtype, "\" (known: ", known_dtypes(), ")"));
      info.numel = 1;
      for (const auto& d : v["shape"]) {
        if (!d.is_number_unsigned()) throw tbad(cat("shape ", v["shape"].dump(), " has a non-integer or negative dimension"));
        uint64_t dim = d.get<uint64_t>();
        if (dim > 0 && static_cast<uint64_t>(info.numel) > (uint64_t{1} << 62) / dim)
          throw tbad(cat("shape ", v["shape"].dump(), " is too large"));
        info.shape.push_back(static_cast<int64_t>(dim));
        info.numel *= static_cast<int64_t>(dim);
      }
      const auto& off = v["data_offsets"];
      if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
        throw tbad(cat("data_offsets ", off.dump(), " are not non-negative integers"));
      uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
      if (b > e) throw tbad(cat("data_offsets ", off.dump(), ": begin > end"));
      if (e > data_bytes)
        throw tbad(cat("data_offsets ", off.dump(), " end beyond the data section of ", data_bytes,
                       " bytes (file truncated?)"));
      // numel is at most 2^62, so its bytes can exceed 64 bits (2^62 F32 would wrap to 0 and
      // match data_offsets [0, 0]).
      uint64_t expect = 0;
      if (__builtin_mul_overflow(static_cast<uint64_t>(info.numel), uint64_t{esize}, &expect))
        throw tbad(cat("shape ", v["shape"].dump(), " of ", info.dtype, " is too large (more than 2^64 bytes)"));
      if (e - b != expect)
        throw tbad(cat("data_offsets ", off.dump(), " span ", e - b, " bytes but ", info.dtype, " ",
                       info.shape_str(), " needs ", expect));
      info.offset = b;
      info.nbytes = e - b;
      by_offset.emplace_back(b, name);
      entries_.emplace(name, std::move(info));
    }
    std::sort(by_offset.begin(), by_offset.end());
    size_t prev_end = 0;
    std::string prev_name;
    for (auto& [b, name] : by_offset) {
      const auto& info = entries_.at(name);
      if (info.nbytes > 0 && b < prev_end)
        throw bad(cat("tensors '", prev_name, "' and '", name, "' overlap in the data section"));
      if (info.nbytes > 0) {
        prev_end = b + info.nbytes;
        prev_name = name;
      }
      order_.push_back(name);
    }
    // The data section ends where its last tensor ends, as every writer lays
    // it out (and the reference implementation requires): bytes after it mean
    // a header length short of the header's padding, which moves the data
    // section's start and so every tensor onto the wrong bytes, or a damaged
    // last data_offsets. (Holes between tensors are allowed.)
    if (prev_end != data_bytes)
      throw bad(cat("the tensors end at byte ", prev_end, " of the data section, which holds ", data_bytes,
                    " bytes: the header length (", hlen, ") or the data_offsets are damaged, or bytes were appended"));
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafeTensorsFile::SafeTensorsFile(SafeTensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(o.map_),
      map_bytes_(o.map_bytes_),
      data_(o.data_),
      entries_(std::move(o.entries_)),
      order_(std::move(o.order_)),
      metadata_(std::move(o.metadata_)) {
  o.map_ = nullptr;
  o.data_ = nullptr;
}

SafeTensorsFile::~SafeTensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

const SafeTensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::string some;
    for (size_t i = 0; i < order_.size() && i < 8; ++i) some += (i ? ", " : "") + order_[i];
    if (order_.size() > 8) some += ", ...";
    throw Error(cat(path_, ": no tensor named '", name, "' (the file has ", order_.size(), " tensors: ", some, ")"));
  }
  return it->second;
}

std::span<const std::byte> SafeTensorsFile::raw(const std::string& name) const {
  const auto& i = info(name);
  return {data_ + i.offset, i.nbytes};
}

void SafeTensorsFile::read_f32(const std::string& name, float* dst, int64_t numel) const {
  const auto& i = info(name);
  if (numel != i.numel)
    throw Error(cat(path_, ": tensor '", name, "' has ", i.numel, " elements (shape ", i.shape_str(),
                    ") but the destination expects ", numel));
  const std::byte* p = data_ + i.offset;
  // memcpy per element: the data section is only 8-byte aligned relative to
  // the header, so typed loads could be misaligned.
  if (i.dtype == "F32") {
    std::memcpy(dst, p, i.nbytes);
  } else if (i.dtype == "BF16") {
    for (int64_t k = 0; k < numel; ++k) {
      uint16_t h;
      std::memcpy(&h, p + 2 * k, 2);
      dst[k] = bf16_to_f32(h);
    }
  } else if (i.dtype == "F16") {
    for (int64_t k = 0; k < numel; ++k) {
      uint16_t h;
      std::memcpy(&h, p + 2 * k, 2);
      dst[k] = f16_to_f32(h);
    }
  } else if (i.dtype == "F64") {
    for (int64_t k = 0; k < numel; ++k) {
      double d;
      std::memcpy(&d, p + 8 * k, 8);
      dst[k] = static_cast<float>(d);
    }
  } else {
    throw Error(cat(path_, ": tensor '", name, "' has dtype ", i.dtype,
                    "; expected a floating type (F32, BF16, F16 or F64)"));
  }
}

std::vector<float> SafeTensorsFile::read_f32(const std::string& name) const {
  std::vector<float> v(static_cast<size_t>(info(name).numel));
  read_f32(name, v.data(), static_cast<int64_t>(v.size()));
  return v;
}

std::vector<int64_t> SafeTensorsFile::read_i64(const std::string& name) const {
  const auto& i = info(name);
  std::vector<int64_t> out(static_cast<size_t>(i.numel));
  const std::byte* p = data_ + i.offset;
  auto load = [&](auto tag) {
    using T = decltype(tag);
    for (int64_t k = 0; k < i.numel; ++k) {
      T v;
      std::memcpy(&v, p + sizeof(T) * k, sizeof(T));
      out[k] = static_cast<int64_t>(v);
    }
  };
  if (i.dtype == "I64") load(int64_t{});
  else if (i.dtype == "I32") load(int32_t{});
  else if (i.dtype == "I16") load(int16_t{});
  else if (i.dtype == "I8") load(int8_t{});
  else if (i.dtype == "U32") load(uint32_t{});
  else if (i.dtype == "U16") load(uint16_t{});
  else if (i.dtype == "U8" || i.dtype == "BOOL") load(uint8_t{});
  else
    throw Error(cat(path_, ": tensor '", name, "' has dtype ", i.dtype,
                    "; expected an integer type (I64, I32, I16, I8, U32, U16, U8, BOOL)"));
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafeTensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json hdr = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (auto& [k, v] : metadata) m[k] = v;
    hdr["__metadata__"] = m;
  }
  std::set<std::string> seen;
  size_t off = 0;
  for (const auto& e : entries) {
    auto ebad = [&](const std::string& what) {
      return Error(cat("cannot write ", path, ": tensor '", e.name, "' ", what));
    };
    if (e.name.empty() || e.name == "__metadata__") throw ebad("has a reserved or empty name");
    if (!seen.insert(e.name).second) throw ebad("appears twice");
    std::string out = st_name(e.out);
    if (out.empty()) throw ebad(cat("asks for stored dtype ", dtype_name(e.out), " (supported: f32, bf16, f16, f64, int32)"));
    if (e.dtype != e.out && !(e.dtype == DType::f32 && e.out == DType::bf16))
      throw ebad(cat("converts ", dtype_name(e.dtype), " to ", dtype_name(e.out), "; only fp32 -> bf16 is supported"));
    int64_t numel = 1;
    for (auto d : e.shape) {
      if (d < 0) throw ebad(cat("has a negative dimension in ", shape_string(e.shape)));
      numel *= d;
    }
    if (numel > 0 && e.data == nullptr) throw ebad("has no data");
    size_t bytes = static_cast<size_t>(numel) * dtype_size(e.out);
    hdr[e.name] = {{"dtype", out}, {"shape", e.shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string h = hdr.dump();
  // The data section must start 8-byte aligned (the format pads the header with spaces).
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  uint64_t hlen = h.size();
  ckpt::AtomicFile f(path);
  f.write(&hlen, 8);
  f.write(h);
  std::vector<uint16_t> buf;
  for (const auto& e : entries) {
    int64_t numel = 1;
    for (auto d : e.shape) numel *= d;
    if (e.dtype == e.out) {
      f.write(e.data, static_cast<size_t>(numel) * dtype_size(e.out));
      continue;
    }
    // fp32 -> bf16 in chunks, so exporting a large model needs no second copy of it.
    const float* src = static_cast<const float*>(e.data);
    constexpr int64_t kChunk = 1 << 20;
    buf.resize(static_cast<size_t>(std::min(numel, kChunk)));
    for (int64_t s = 0; s < numel; s += kChunk) {
      int64_t n = std::min(kChunk, numel - s);
      for (int64_t k = 0; k < n; ++k) buf[k] = f32_to_bf16(src[s + k]);
      f.write(buf.data(), static_cast<size_t>(n) * 2);
    }
  }
  f.commit();
}

}  // namespace loom::hf
