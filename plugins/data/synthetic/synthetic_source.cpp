#include "data/synthetic/synthetic_source.hpp"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "data/common/data_state.hpp"
#include "loom/ops/hash.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom::data {

namespace {
// Hash domains keep train and validation streams (and token vs start hashes) apart.
constexpr uint64_t kTrainDomain = 0x545241494eull;  // "TRAIN"
constexpr uint64_t kValDomain = 0x56414cull;        // "VAL"
constexpr uint64_t kStartTag = 0x5354415254ull;     // "START"
constexpr uint64_t kDocTag = 0x444f43554dull;       // "DOCUM"
}  // namespace

SyntheticSource::SyntheticSource(SyntheticOptions opt) : opt_(std::move(opt)) {
  if (opt_.pattern != "random" && opt_.pattern != "ramp")
    throw Error(cat("data plugin 'synthetic': pattern = \"", opt_.pattern, "\" is not known; use \"random\" or \"ramp\""));
  if (!(opt_.document_length == 0 || opt_.document_length >= 1) || !(opt_.document_sigma >= 0))
    throw Error(cat("data plugin 'synthetic': document_length = ", opt_.document_length, ", document_sigma = ",
                    opt_.document_sigma, ": give a mean length of at least 1 token (0: no documents) and sigma >= 0"));
  if (opt_.vocab < 0)
    throw Error(cat("data plugin 'synthetic': vocab = ", opt_.vocab, " is negative; use a positive size or leave it out "
                    "to take the model's vocab_size"));
  ramp_ = opt_.pattern == "ramp";
}

void SyntheticSource::open(const DataSpec& spec) {
  if (spec.batch < 1 || spec.seq_len < 1 || spec.vocab_size < 1 || spec.world < 1 || spec.rank < 0 ||
      spec.rank >= spec.world)
    throw Error(cat("data plugin 'synthetic': invalid spec (batch ", spec.batch, ", seq_len ", spec.seq_len,
                    ", vocab_size ", spec.vocab_size, ", rank ", spec.rank, " of ", spec.world,
                    "); all must be positive and rank < world"));
  if (opt_.vocab > spec.vocab_size)
    throw Error(cat("data plugin 'synthetic': vocab = ", opt_.vocab, " is larger than the model's vocab_size ",
                    spec.vocab_size, opt_.vocab > kMaxVocabSize
                        ? cat(", and beyond what Loom supports (model.vocab_size is at most ", kMaxVocabSize,
                              ": token ids are int32); lower data.vocab")
                        : std::string("; lower data.vocab or raise model.vocab_size")));
  spec_ = spec;
  vocab_ = opt_.vocab > 0 ? opt_.vocab : spec.vocab_size;
  seed_ = spec.seed;
  cursor_ = val_cursor_ = 0;
  opened_ = true;
}

int32_t SyntheticSource::token(Split split, uint64_t sample, uint64_t pos) const {
  const uint64_t domain = split == Split::train ? kTrainDomain : kValDomain;
  const uint64_t v = static_cast<uint64_t>(vocab_);
  if (ramp_) {
    const uint64_t start = bounded(hash_of(seed_, domain, kStartTag, sample), v);
    return static_cast<int32_t>((start + pos) % v);
  }
  return static_cast<int32_t>(bounded(hash_of(seed_, domain, sample, pos), v));
}

void SyntheticSource::next(Split split, int32_t* tokens) { next_with_starts(split, tokens, nullptr); }

std::string SyntheticSource::starts_unavailable() const {
  if (opt_.document_length > 0) return {};
  return "synthetic data has no documents unless data.document_length (their mean length in tokens) is set";
}

void SyntheticSource::starts(Split split, uint64_t sample, uint8_t* out) const {
  const uint64_t row = static_cast<uint64_t>(spec_.seq_len) + 1;
  const uint64_t domain = split == Split::train ? kTrainDomain : kValDomain;
  // log-normal with mean m: exp(mu + sigma z), mu = ln m - sigma^2 / 2.
  const double sigma = opt_.document_sigma, mu = std::log(opt_.document_length) - sigma * sigma / 2;
  auto length = [&](uint64_t k) {
    // z ~ N(0, 1) by Box-Muller from two hashed uniforms in (0, 1).
    const double u1 = (static_cast<double>(hash_of(seed_, domain, kDocTag, sample, k, 1) >> 11) + 0.5) * 0x1p-53;
    const double u2 = (static_cast<double>(hash_of(seed_, domain, kDocTag, sample, k, 2) >> 11) + 0.5) * 0x1p-53;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
    return static_cast<uint64_t>(std::clamp(std::ceil(std::exp(mu + sigma * z)), 1.0, 1e15));
  };
  std::fill(out, out + row, uint8_t{0});
  // The row begins inside document 0, a uniformly drawn number of its tokens before its end.
  uint64_t at = 1 + bounded(hash_of(seed_, domain, kDocTag, sample, 0, 3), length(0));
  for (uint64_t k = 1; at < row; ++k) {
    out[at] = 1;
    at += length(k);
  }
}

void SyntheticSource::next_with_starts(Split split, int32_t* tokens, uint8_t* starts) {
  if (!opened_) throw Error("data plugin 'synthetic': next() called before open()");
  if (starts && opt_.document_length <= 0) throw Error(cat("data plugin 'synthetic': ", starts_unavailable()));
  const uint64_t B = static_cast<uint64_t>(spec_.batch), row = static_cast<uint64_t>(spec_.seq_len) + 1;
  uint64_t& cur = split == Split::train ? cursor_ : val_cursor_;
  const uint64_t first = cur + static_cast<uint64_t>(spec_.rank) * B;
  for (uint64_t i = 0; i < B; ++i) {
    for (uint64_t p = 0; p < row; ++p) tokens[i * row + p] = token(split, first + i, p);
    if (starts) this->starts(split, first + i, starts + i * row);
  }
  cur += B * static_cast<uint64_t>(spec_.world);
}

void SyntheticSource::reset(Split split) {
  if (split == Split::train)
    throw Error("data plugin 'synthetic': reset() restarts the validation split only; the train position "
                "is set through restore()");
  val_cursor_ = 0;
}

std::string SyntheticSource::state() const {
  if (!opened_) throw Error("data plugin 'synthetic': state() called before open()");
  return nlohmann::json{{"source", "synthetic"}, {"version", 1},        {"cursor", cursor_},
                        {"seed", seed_},         {"world", spec_.world}, {"batch", spec_.batch},
                        {"pattern", opt_.pattern}, {"vocab", vocab_}}
      .dump();
}

void SyntheticSource::restore(const std::string& state) {
  if (!opened_) throw Error("data plugin 'synthetic': restore() called before open()");
  // Every field is read and checked before any is taken: a refused state leaves the source as it was.
  const DataStateReader r(state, "synthetic", 1);
  const std::string pattern = r.string("pattern");
  if (pattern != "random" && pattern != "ramp") r.fail("pattern", pattern, "\"random\" or \"ramp\"");
  const int64_t vocab = r.integer("vocab", 1, kMaxVocabSize);
  const DataStateReader::Position at = r.position();
  if (pattern != opt_.pattern || vocab != vocab_)
    log_warn(cat("synthetic: the checkpoint's data was pattern \"", pattern, "\" over ", vocab,
                 " ids, the run now generates pattern \"", opt_.pattern, "\" over ", vocab_,
                 " ids; the position carries over, the tokens differ"));
  cursor_ = at.cursor;
  seed_ = at.seed;  // the checkpoint's stream continues, whatever the run's seed
  DataStateReader::note_reshard("synthetic", at, spec_.world, spec_.batch, "sample");
  val_cursor_ = 0;
}

}  // namespace loom::data
