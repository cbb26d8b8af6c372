#include "train/rank_agreement.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "checkpoint/train_checkpoint.hpp"
#include "loom/error.hpp"
#include "loom/version.hpp"

namespace loom {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string serialise(const std::map<std::string, std::string>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += k + "\x1f" + v + "\x1e";
  return out;
}

std::map<std::string, std::string> deserialise(const std::string& s) {
  std::map<std::string, std::string> m;
  size_t at = 0;
  while (at < s.size()) {
    const size_t us = s.find('\x1f', at), rs = s.find('\x1e', at);
    if (us == std::string::npos || rs == std::string::npos || us > rs) break;
    m[s.substr(at, us - at)] = s.substr(us + 1, rs - us - 1);
    at = rs + 1;
  }
  return m;
}

// All ranks' byte strings, through two all_gathers (lengths, then the
// padded texts; all_gather moves raw bytes, so 8-byte words travel as f64).
std::vector<std::string> gather_texts(Communicator& host, const std::string& mine) {
  const int p = host.size();
  std::vector<double> lens(static_cast<size_t>(p));
  {
    int64_t n = static_cast<int64_t>(mine.size());
    double word;
    std::memcpy(&word, &n, 8);
    Tensor in(&word, DType::f64, Device::cpu, {1});
    Tensor out(lens.data(), DType::f64, Device::cpu, {p});
    host.all_gather(ExecContext{}, in, out);
  }
  int64_t longest = 0;
  std::vector<int64_t> n(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    std::memcpy(&n[static_cast<size_t>(r)], &lens[static_cast<size_t>(r)], 8);
    longest = std::max(longest, n[static_cast<size_t>(r)]);
  }
  const int64_t words = (longest + 7) / 8 + 1;
  std::vector<double> buf(static_cast<size_t>(words), 0.0), all(static_cast<size_t>(words * p), 0.0);
  std::memcpy(buf.data(), mine.data(), mine.size());
  Tensor in(buf.data(), DType::f64, Device::cpu, {words});
  Tensor out(all.data(), DType::f64, Device::cpu, {words * p});
  host.all_gather(ExecContext{}, in, out);
  std::vector<std::string> texts;
  for (int r = 0; r < p; ++r)
    texts.emplace_back(reinterpret_cast<const char*>(all.data() + static_cast<size_t>(r * words)),
                       static_cast<size_t>(n[static_cast<size_t>(r)]));
  return texts;
}

std::string shown(const std::map<std::string, std::string>& m, const std::string& k) {
  auto it = m.find(k);
  return it == m.end() ? std::string("(not set)") : it->second;
}

}  // namespace

std::map<std::string, std::string> agreement_keys(const Config& cfg, const ModelSpec& spec, const Runtime& rt) {
  std::map<std::string, std::string> m;
  for (auto& [k, v] : flatten_config_toml(cfg.effective_toml)) {
    if (k == "run.plugin_path" || k == "run.log_level") continue;
    const bool plugin_path = (k.rfind("precision.", 0) == 0 || k.rfind("attention.", 0) == 0 ||
                              k.rfind("sharding.", 0) == 0 || k.rfind("data.", 0) == 0) &&
                             k.size() > 5 && k.compare(k.size() - 5, 5, ".path") == 0 &&
                             std::count(k.begin(), k.end(), '.') == 1;
    if (plugin_path) continue;
    m[k] = v;
  }
  // With an HF folder the architecture comes from its config.json, which the
  // config's keys do not show (each node may read its own copy).
  if (cfg.model.init.rfind("hf:", 0) == 0) m["model (config.json of " + cfg.model.init.substr(3) + ")"] = ckpt::model_json(spec);
  m["loom"] = cat(version_string(), " (", build_id(), ")");
  if (rt.registry)
    for (const PluginRecord& r : rt.registry->loaded())
      m[cat("plugin ", plugin_kind_name(r.kind), " '", r.name, "'")] =
          cat("version ", r.version, ", build id ", r.build_id);
  return m;
}

void check_ranks_agree(const Config& cfg, const ModelSpec& spec, const Runtime& rt) {
  Communicator& host = *rt.host;
  const int p = host.size();
  if (p == 1) return;
  const std::map<std::string, std::string> mine = agreement_keys(cfg, spec, rt);
  const std::string text = serialise(mine);
  std::vector<double> digests(static_cast<size_t>(p));
  {
    const uint64_t h = fnv1a(text);
    double word;
    std::memcpy(&word, &h, 8);
    Tensor in(&word, DType::f64, Device::cpu, {1});
    Tensor out(digests.data(), DType::f64, Device::cpu, {p});
    host.all_gather(ExecContext{}, in, out);
  }
  bool same = true;
  for (int r = 1; r < p; ++r)
    same = same && std::memcmp(&digests[0], &digests[static_cast<size_t>(r)], 8) == 0;
  if (same) return;

  // Every rank takes part in this exchange (all saw the digests differ) and
  // reaches the same message.
  const std::vector<std::string> texts = gather_texts(host, text);
  const std::map<std::string, std::string> ref = deserialise(texts[0]);
  std::string diffs;
  int shown_keys = 0;
  for (int r = 1; r < p; ++r) {
    const std::map<std::string, std::string> other = deserialise(texts[static_cast<size_t>(r)]);
    std::vector<std::string> keys;
    for (auto& [k, v] : ref)
      if (shown(other, k) != v) keys.push_back(k);
    for (auto& [k, v] : other)
      if (!ref.count(k)) keys.push_back(k);
    for (const std::string& k : keys) {
      if (shown_keys++ == 12) diffs += "; ...";
      if (shown_keys > 12) break;
      diffs += cat(diffs.empty() ? "" : "; ", k, ": rank 0 has ", shown(ref, k), ", rank ", r, " has ", shown(other, k));
    }
  }
  throw Error(cat("the ", p, " ranks were not started with the same configuration and plugins, which would make them "
                  "fail inside a collective or train different models: ", diffs,
                  ". Start every rank with the same config file, --set overrides, plugins and model folder"));
}

}  // namespace loom
