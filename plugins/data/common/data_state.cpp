#include "data/common/data_state.hpp"

#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom::data {
namespace {

// How every refusal of a damaged field ends (the core puts the file in front
// and which checkpoint to resume instead after it).
constexpr const char* kDamaged = " (meta.json edited or damaged); the checkpoint cannot be used";

std::string shown(const std::string& text) {
  return text.size() > 60 ? text.substr(0, 57) + "..." : text;
}

}  // namespace

DataStateReader::DataStateReader(const std::string& text, const std::string& source, int64_t version)
    : f_("", kDamaged) {
  try {
    j_ = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw ckpt::CheckpointDamaged(cat("it is '", shown(text), "', not valid JSON (data plugin '", source,
                                      "' writes a JSON object)", kDamaged));
  }
  if (!j_.is_object())
    throw ckpt::CheckpointDamaged(cat("it is ", shown(j_.dump()), ", not a JSON object (data plugin '", source,
                                      "' writes one)", kDamaged));
  // Another plugin's state is not damage: the run names another data plugin.
  if (const auto it = j_.find("source"); it != j_.end() && it->is_string() && *it != source)
    throw Error(cat("it was written by data plugin '", it->get<std::string>(), "', not '", source,
                    "': resume with data.plugin = \"", it->get<std::string>(),
                    "\", or start afresh from this config (checkpoint.resume = \"none\")"));
  if (string("source") != source) fail("source", j_.at("source"), cat("\"", source, "\""));
  const int64_t v = integer("version", 1);
  if (v != version)
    throw Error(cat("it is in format version ", v, " of data plugin '", source, "', which reads version ", version,
                    " only: resume with the Loom that wrote it, or start afresh (checkpoint.resume = \"none\")"));
}

void DataStateReader::damaged(const std::string& what) const { throw ckpt::CheckpointDamaged(cat(what, kDamaged)); }

void DataStateReader::note_reshard(const std::string& source, const Position& p, int64_t world, int64_t batch,
                                   const char* unit) {
  if (p.world != world || p.batch != batch)
    log_info(cat(source, ": checkpoint taken with world ", p.world, " x batch ", p.batch, ", resuming with world ", world,
                 " x batch ", batch, "; continuing from global ", unit, " ", p.cursor));
}

bool DataStateReader::boolean(const std::string& name) const {
  std::string key;
  return f_.boolean(f_.member(j_, "", name, key, "true or false"), key);
}

}  // namespace loom::data
