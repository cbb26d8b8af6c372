#include "data/synthetic/synthetic_source.hpp"

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
}  // namespace

SyntheticSource::SyntheticSource(SyntheticOptions opt) : opt_(std::move(opt)) {
  if (opt_.pattern != "random" && opt_.pattern != "ramp")
    throw Error(cat("data plugin 'synthetic': pattern = \"", opt_.pattern, "\" is not known; use \"random\" or \"ramp\""));
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

void SyntheticSource::next(Split split, int32_t* tokens) {
  if (!opened_) throw Error("data plugin 'synthetic': next() called before open()");
  const uint64_t B = static_cast<uint64_t>(spec_.batch), row = static_cast<uint64_t>(spec_.seq_len) + 1;
  uint64_t& cur = split == Split::train ? cursor_ : val_cursor_;
  const uint64_t first = cur + static_cast<uint64_t>(spec_.rank) * B;
  for (uint64_t i = 0; i < B; ++i)
    for (uint64_t p = 0; p < row; ++p) tokens[i * row + p] = token(split, first + i, p);
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
