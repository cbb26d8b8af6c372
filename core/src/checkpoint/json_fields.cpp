#include "loom/json_fields.hpp"

#include <cmath>

#include "checkpoint/checkpoint.hpp"

namespace loom::ckpt {
namespace {

// The value as found, short enough for one line (a damaged field may hold anything).
std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string integer_words(int64_t lo, int64_t hi) {
  if (hi == JsonFields::kMaxInt) return cat("an integer >= ", lo);
  return cat("an integer in ", integer_range(lo, hi));
}

}  // namespace

std::string integer_range(int64_t lo, int64_t hi) { return cat("[", lo, ", ", hi, "]"); }

void JsonFields::fail(const std::string& key, const json& found, const std::string& expected) const {
  throw CheckpointDamaged(cat(lead(), "\"", key, "\" is ", shown(found), ", expected ", expected, tail_));
}

void JsonFields::missing(const std::string& key, const std::string& expected) const {
  throw CheckpointDamaged(cat(lead(), "\"", key, "\" is missing (expected ", expected, ")", tail_));
}

std::string JsonFields::lead() const { return file_.empty() ? std::string() : file_ + ": "; }

const nlohmann::json* JsonFields::find(const json& obj, const std::string& at, const std::string& name,
                                       std::string& full) const {
  full = at.empty() ? name : at + "." + name;
  if (!obj.is_object()) fail(at.empty() ? std::string("(the whole file)") : at, obj, "a JSON object");
  const auto it = obj.find(name);
  return it == obj.end() ? nullptr : &*it;
}

const nlohmann::json& JsonFields::member(const json& obj, const std::string& at, const std::string& name,
                                         std::string& full, const std::string& expected) const {
  const json* v = find(obj, at, name, full);
  if (!v) missing(full, expected);
  return *v;
}

int64_t JsonFields::integer(const json& v, const std::string& key, int64_t lo, int64_t hi) const {
  if (!v.is_number_integer()) fail(key, v, integer_words(lo, hi));
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (hi < 0 || u > static_cast<uint64_t>(hi) || (lo > 0 && u < static_cast<uint64_t>(lo)))
      fail(key, v, integer_words(lo, hi));
    return static_cast<int64_t>(u);
  }
  const int64_t s = v.get<int64_t>();
  if (s < lo || s > hi) fail(key, v, integer_words(lo, hi));
  return s;
}

uint32_t JsonFields::crc32(const json& v, const std::string& key) const {
  if (!v.is_number_integer() || !v.is_number_unsigned() || v.get<uint64_t>() > 0xFFFFFFFFull)
    fail(key, v, "a CRC32: an integer in [0, 4294967295]");
  return static_cast<uint32_t>(v.get<uint64_t>());
}

double JsonFields::number(const json& v, const std::string& key, double lo, double hi, bool hi_open) const {
  const std::string want = cat("a finite number in [", lo, ", ", hi, hi_open ? ")" : "]");
  if (!v.is_number()) fail(key, v, want);
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi || (hi_open && d >= hi)) fail(key, v, want);
  return d;
}

bool JsonFields::boolean(const json& v, const std::string& key) const {
  if (!v.is_boolean()) fail(key, v, "true or false");
  return v.get<bool>();
}

std::string JsonFields::string(const json& v, const std::string& key) const {
  if (!v.is_string()) fail(key, v, "a string");
  return v.get<std::string>();
}

const nlohmann::json& JsonFields::array(const json& v, const std::string& key) const {
  if (!v.is_array()) fail(key, v, "a JSON array");
  return v;
}

const nlohmann::json& JsonFields::object(const json& v, const std::string& key) const {
  if (!v.is_object()) fail(key, v, "a JSON object");
  return v;
}

int64_t JsonFields::integer_at(const json& obj, const std::string& at, const std::string& name, int64_t lo,
                               int64_t hi) const {
  std::string key;
  return integer(member(obj, at, name, key, integer_words(lo, hi)), key, lo, hi);
}

std::string JsonFields::string_at(const json& obj, const std::string& at, const std::string& name) const {
  std::string key;
  return string(member(obj, at, name, key, "a string"), key);
}

std::string JsonFields::string_or(const json& obj, const std::string& at, const std::string& name,
                                  const std::string& def) const {
  std::string key;
  const json* v = find(obj, at, name, key);
  return v ? string(*v, key) : def;
}

const nlohmann::json& JsonFields::array_at(const json& obj, const std::string& at, const std::string& name) const {
  std::string key;
  return array(member(obj, at, name, key, "a JSON array"), key);
}

const nlohmann::json& JsonFields::object_at(const json& obj, const std::string& at, const std::string& name) const {
  std::string key;
  return object(member(obj, at, name, key, "a JSON object"), key);
}

}  // namespace loom::ckpt
