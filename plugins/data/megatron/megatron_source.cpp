#include "data/megatron/megatron_source.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "data/common/data_state.hpp"
#include "loom/ops/hash.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom::data {

struct MegatronSource::Stream {
  const IndexedDataset* ds = nullptr;
  std::size_t dataset = 0;
  uint64_t begin = 0, end = 0;  // sequences [begin, end)
  uint64_t tokens = 0, samples = 0;
  uint64_t doc_seed = 0, sample_seed = 0;
  // The cumulative token counts of the current epoch's document order (the
  // order itself is recomputed per lookup: a permutation costs O(1) memory).
  int64_t epoch = -1;
  std::vector<uint64_t> cum;
  uint64_t docs() const { return end - begin; }
};

std::vector<uint64_t> megatron_split_indices(const std::string& split, uint64_t documents, const std::string& key) {
  std::vector<double> parts;
  std::size_t pos = 0;
  while (pos <= split.size()) {
    std::size_t e = split.find_first_of(",/", pos);
    if (e == std::string::npos) e = split.size();
    // Spaces around a part are allowed, as Python's float() in Megatron allows them ("969, 30, 1").
    std::string tok = split.substr(pos, e - pos);
    tok.erase(0, std::min(tok.find_first_not_of(" \t"), tok.size()));
    tok.erase(tok.find_last_not_of(" \t") + 1);
    std::size_t used = 0;
    double v = -1;
    try {
      v = std::stod(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != tok.size() || !(v >= 0) || !std::isfinite(v))
      throw Error(cat(key, " = \"", split, "\": '", tok, "' is not a non-negative number; write weights of train, ",
                      "validation and test documents as Megatron does, e.g. \"969,30,1\""));
    parts.push_back(v);
    pos = e + 1;
  }
  if (parts.size() > 3)
    throw Error(cat(key, " = \"", split, "\" has ", parts.size(), " parts; give at most 3 (train, validation, test)"));
  parts.resize(3, 0.0);
  const double total = parts[0] + parts[1] + parts[2];
  if (!(total > 0)) throw Error(cat(key, " = \"", split, "\" sums to 0; give the train part a weight, e.g. \"969,30,1\""));
  std::vector<int64_t> idx{0};
  for (int i = 0; i < 3; ++i)
    idx.push_back(idx.back() + static_cast<int64_t>(std::nearbyint(parts[static_cast<std::size_t>(i)] / total *
                                                                   static_cast<double>(documents))));
  const int64_t diff = idx.back() - static_cast<int64_t>(documents);
  for (std::size_t i = 1; i < idx.size(); ++i) idx[i] -= diff;
  std::vector<uint64_t> out;
  for (int64_t v : idx) out.push_back(static_cast<uint64_t>(std::clamp<int64_t>(v, 0, static_cast<int64_t>(documents))));
  return out;
}

MegatronSource::MegatronSource(MegatronOptions opt) : opt_(std::move(opt)) {
  if (opt_.prefixes.empty())
    throw Error("data plugin 'megatron' needs `prefix`: the path prefix of a Megatron dataset (PREFIX.bin + PREFIX.idx), "
                "e.g. prefix = \"data/owt2/owt2_text_document\", or a list of them");
  if (!opt_.weights.empty() && opt_.weights.size() != opt_.prefixes.size())
    throw Error(cat("data.weights has ", opt_.weights.size(), " entries but data.prefix has ", opt_.prefixes.size(),
                    "; give one weight per prefix (or none: proportional to their sizes)"));
  for (double w : opt_.weights)
    if (!(w >= 0) || !std::isfinite(w)) throw Error(cat("data.weights holds ", w, "; weights must be >= 0"));
  if (!opt_.weights.empty() && std::accumulate(opt_.weights.begin(), opt_.weights.end(), 0.0) <= 0)
    throw Error("data.weights sum to 0; give at least one prefix a positive weight");
}

MegatronSource::~MegatronSource() = default;

void MegatronSource::require_open(const char* what) const {
  if (!opened_) throw Error(cat("data plugin 'megatron': ", what, " called before open()"));
}

void MegatronSource::open(const DataSpec& spec) {
  if (spec.batch < 1 || spec.seq_len < 1 || spec.vocab_size < 1 || spec.world < 1 || spec.rank < 0 ||
      spec.rank >= spec.world)
    throw Error(cat("data plugin 'megatron': invalid spec (batch ", spec.batch, ", seq_len ", spec.seq_len, ", rank ",
                    spec.rank, " of ", spec.world, ")"));
  spec_ = spec;
  seed_ = spec.seed;
  datasets_.clear();
  train_.clear();
  val_.clear();
  const bool separate_val = !opt_.val_prefixes.empty();
  if (separate_val && !opt_.split.empty()) {
    // A split may still be given when it leaves validation empty.
    const auto idx = megatron_split_indices(opt_.split, 1000000, "data.split");
    if (idx[2] > idx[1])
      throw Error(cat("data.split = \"", opt_.split, "\" gives validation documents and data.val_prefix names validation ",
                      "datasets too; use one of them (e.g. split = \"1,0,0\" with val_prefix)"));
  }
  const std::string split = !opt_.split.empty() ? opt_.split : separate_val ? "1,0,0" : "969,30,1";
  const uint64_t S = static_cast<uint64_t>(spec.seq_len);
  auto make_stream = [&](const IndexedDataset* ds, std::size_t index, uint64_t b, uint64_t e) {
    auto s = std::make_unique<Stream>();
    s->ds = ds;
    s->dataset = index;
    s->begin = b;
    s->end = e;
    s->tokens = ds->tokens(b, e);
    s->samples = s->tokens >= 1 ? (s->tokens - 1) / S : 0;
    s->doc_seed = hash_of(seed_, 0x444f4353ull /* "DOCS" */, index);
    s->sample_seed = hash_of(seed_, 0x53414d50ull /* "SAMP" */, index);
    return s;
  };
  for (std::size_t i = 0; i < opt_.prefixes.size(); ++i) {
    datasets_.push_back(std::make_unique<IndexedDataset>(opt_.prefixes[i]));
    const IndexedDataset& ds = *datasets_.back();
    const auto idx = megatron_split_indices(split, ds.sequences(), "data.split");
    auto t = make_stream(&ds, i, idx[0], idx[1]);
    if (t->samples == 0)
      throw Error(cat("Megatron dataset '", ds.prefix(), "': its train split (documents [", idx[0], ", ", idx[1], ") of ",
                      ds.sequences(), " under split \"", split, "\") has ", t->tokens,
                      " tokens, less than one sample of seq_len + 1 = ", S + 1, "; use more data or a shorter seq_len"));
    train_.push_back(std::move(t));
    if (!separate_val && idx[2] > idx[1]) val_.push_back(make_stream(&ds, i, idx[1], idx[2]));
  }
  for (std::size_t i = 0; i < opt_.val_prefixes.size(); ++i) {
    datasets_.push_back(std::make_unique<IndexedDataset>(opt_.val_prefixes[i], "data.val_prefix"));
    const IndexedDataset& ds = *datasets_.back();
    val_.push_back(make_stream(&ds, opt_.prefixes.size() + i, 0, ds.sequences()));
  }
  val_total_ = 0;
  for (auto& v : val_) val_total_ += v->samples;
  if (!val_.empty() && val_total_ == 0)
    throw Error(cat("data plugin 'megatron': the validation documents hold no sample of seq_len + 1 = ", S + 1,
                    " tokens; give validation a larger share (data.split) or another dataset (data.val_prefix)"));
  // Weights: the user's, else proportional to each dataset's train samples.
  weights_.clear();
  double total = 0;
  for (std::size_t i = 0; i < train_.size(); ++i) {
    weights_.push_back(opt_.weights.empty() ? static_cast<double>(train_[i]->samples) : opt_.weights[i]);
    total += weights_.back();
  }
  for (double& w : weights_) w /= total;
  counts_.assign(train_.size(), 0);
  cursor_ = val_cursor_ = 0;
  opened_ = true;
  for (std::size_t i = 0; i < train_.size(); ++i) {
    const Stream& s = *train_[i];
    log_info(cat("megatron: '", s.ds->prefix(), "' (", s.ds->dtype_name(), ", ", s.ds->sequences(), " documents, ",
                 s.ds->tokens(), " tokens): train documents [", s.begin, ", ", s.end, "), ", s.samples,
                 " samples of ", S + 1, " tokens an epoch, weight ", weights_[i]));
  }
  if (!val_.empty()) log_info(cat("megatron: validation: ", val_total_, " samples"));
}

bool MegatronSource::has_split(Split split) const { return split == Split::train || !val_.empty(); }

uint64_t MegatronSource::train_samples(std::size_t dataset) const { return train_.at(dataset)->samples; }

void MegatronSource::read_sample(Stream& s, uint64_t k, bool shuffle, int32_t* out, uint8_t* starts) const {
  const uint64_t S = static_cast<uint64_t>(spec_.seq_len);
  const uint64_t epoch = k / s.samples, pos = k % s.samples;
  const uint64_t j = shuffle ? IndexPermutation(s.samples, s.sample_seed, epoch)(pos) : pos;
  const IndexPermutation doc_order(s.docs(), s.doc_seed, epoch);
  auto doc = [&](uint64_t i) { return s.begin + (shuffle ? doc_order(i) : i); };
  if (s.epoch != static_cast<int64_t>(epoch)) {
    // A new pass over the files: they must still be the ones this run opened
    // (a .bin rewritten in place would be read as new tokens unnoticed).
    s.ds->verify_unchanged();
    s.cum.assign(s.docs() + 1, 0);
    for (uint64_t i = 0; i < s.docs(); ++i) s.cum[i + 1] = s.cum[i] + s.ds->length(doc(i));
    s.epoch = static_cast<int64_t>(epoch);
  }
  uint64_t offset = j * S, need = S + 1;
  uint64_t i = static_cast<uint64_t>(std::upper_bound(s.cum.begin(), s.cum.end(), offset) - s.cum.begin()) - 1;
  while (need > 0) {
    const uint64_t seq = doc(i), in_doc = offset - s.cum[i];
    const uint64_t n = std::min<uint64_t>(need, s.ds->length(seq) - in_doc);
    s.ds->read(seq, in_doc, n, out, spec_.vocab_size);
    if (starts && n > 0) {
      for (uint64_t t = 0; t < n; ++t) starts[t] = 0;
      starts[0] = in_doc == 0 ? 1 : 0;  // the document's first token, or a continuation
      starts += n;
    }
    out += n;
    need -= n;
    offset += n;
    ++i;  // documents of length 0 are passed over: their range is empty
  }
}

// Megatron's build_blending_indices: sample g goes to the dataset whose count
// lags weight * max(g, 1) the most (the first on ties).
std::size_t MegatronSource::choose(uint64_t g) const {
  const double x = std::max(static_cast<double>(g), 1.0);
  std::size_t best = 0;
  double best_err = weights_[0] * x - static_cast<double>(counts_[0]);
  for (std::size_t d = 1; d < weights_.size(); ++d) {
    const double err = weights_[d] * x - static_cast<double>(counts_[d]);
    if (err > best_err) {
      best_err = err;
      best = d;
    }
  }
  return best;
}

void MegatronSource::next(Split split, int32_t* tokens) { read(split, tokens, nullptr); }

void MegatronSource::next_with_starts(Split split, int32_t* tokens, uint8_t* starts) { read(split, tokens, starts); }

void MegatronSource::read(Split split, int32_t* tokens, uint8_t* starts) {
  require_open("next()");
  const uint64_t B = static_cast<uint64_t>(spec_.batch), row = static_cast<uint64_t>(spec_.seq_len) + 1;
  const uint64_t per_step = B * static_cast<uint64_t>(spec_.world);
  const uint64_t first = static_cast<uint64_t>(spec_.rank) * B;
  if (split == Split::validation) {
    if (val_.empty())
      throw Error("data plugin 'megatron' has no validation split: give data.split a validation part (e.g. \"969,30,1\") "
                  "or data.val_prefix");
    for (uint64_t i = 0; i < B; ++i) {
      uint64_t v = (val_cursor_ + first + i) % val_total_;
      std::size_t k = 0;
      while (v >= val_[k]->samples) v -= val_[k++]->samples;
      read_sample(*val_[k], v, false, tokens + i * row, starts ? starts + i * row : nullptr);
    }
    val_cursor_ += per_step;
    return;
  }
  // Every rank walks the whole global batch so that the per-dataset counts stay equal on all ranks.
  for (uint64_t i = 0; i < per_step; ++i) {
    const std::size_t d = choose(cursor_ + i);
    const uint64_t k = counts_[d]++;
    if (i >= first && i < first + B)
      read_sample(*train_[d], k, opt_.shuffle, tokens + (i - first) * row,
                  starts ? starts + (i - first) * row : nullptr);
  }
  cursor_ += per_step;
}

void MegatronSource::reset(Split split) {
  if (split == Split::train)
    throw Error("data plugin 'megatron': reset() restarts the validation split only; the train position is set through "
                "restore()");
  for (auto& s : val_) s->ds->verify_unchanged();  // each evaluation is a new pass over the validation files
  val_cursor_ = 0;
}

std::string MegatronSource::state() const {
  require_open("state()");
  // A checkpoint records a position in these files: they must be the ones opened.
  for (auto& s : train_) s->ds->verify_unchanged();
  nlohmann::json ds = nlohmann::json::array();
  for (auto& s : train_)
    ds.push_back({{"prefix", s->ds->prefix()}, {"sequences", s->ds->sequences()}, {"tokens", s->ds->tokens()},
                  {"train_documents", {s->begin, s->end}}});
  nlohmann::json j = {{"source", "megatron"}, {"version", 1},         {"cursor", cursor_},
                      {"counts", counts_},    {"weights", weights_},   {"seed", seed_},
                      {"world", spec_.world}, {"batch", spec_.batch}, {"seq_len", spec_.seq_len},
                      {"shuffle", opt_.shuffle}, {"datasets", ds}};
  return j.dump();
}

TokenScanReport MegatronSource::scan_tokens() const {
  require_open("scan_tokens()");
  // The documents each split reads (the test share of data.split never is).
  TokenScanReport r;
  std::vector<const IndexedDataset*> seen;
  for (const auto* streams : {&train_, &val_})
    for (const auto& s : *streams) {
      r.tokens += s->ds->scan(s->begin, s->end, spec_.vocab_size);
      if (std::find(seen.begin(), seen.end(), s->ds) == seen.end()) seen.push_back(s->ds);
    }
  r.files = 2 * seen.size();
  r.what = cat(seen.size(), " Megatron dataset(s): the train", val_.empty() ? "" : " and validation",
               " documents");
  return r;
}

void MegatronSource::restore(const std::string& state) {
  require_open("restore()");
  // Every field is read and checked before any is compared or taken: a
  // damaged field is told as that, and a refused state leaves the source as it was.
  const DataStateReader r(state, "megatron", 1);
  const ckpt::JsonFields& f = r.fields();
  struct Dataset {
    std::string prefix;
    uint64_t sequences, tokens, begin, end;
  };
  std::vector<Dataset> was;
  const nlohmann::json& listed = r.array("datasets");
  for (std::size_t i = 0; i < listed.size(); ++i) {
    const std::string at = cat("datasets[", i, "]");
    Dataset d;
    d.prefix = f.string_at(listed[i], at, "prefix");
    d.sequences = static_cast<uint64_t>(f.integer_at(listed[i], at, "sequences"));
    d.tokens = static_cast<uint64_t>(f.integer_at(listed[i], at, "tokens"));
    const nlohmann::json& docs = f.array_at(listed[i], at, "train_documents");
    const std::string dk = at + ".train_documents";
    if (docs.size() != 2) r.fail(dk, docs, "[first, end): two document numbers");
    d.begin = static_cast<uint64_t>(f.integer(docs[0], dk + "[0]", 0, static_cast<int64_t>(d.sequences)));
    d.end = static_cast<uint64_t>(f.integer(docs[1], dk + "[1]", static_cast<int64_t>(d.begin),
                                            static_cast<int64_t>(d.sequences)));
    was.push_back(std::move(d));
  }
  const std::size_t n = was.size();
  const int64_t seq_len = r.integer("seq_len", 1, kMaxDataDim);
  const bool shuffle = r.boolean("shuffle");
  const DataStateReader::Position at = r.position();
  const uint64_t cursor = at.cursor;
  // One count per dataset; every global sample went to exactly one: they sum to the cursor.
  const nlohmann::json& listed_counts = r.array("counts");
  if (listed_counts.size() != n)
    r.damaged(cat("\"counts\" has ", listed_counts.size(), " per-dataset count(s) for ", n,
                  " dataset(s) (\"datasets\"): one per dataset"));
  std::vector<uint64_t> counts;
  uint64_t sum = 0;  // at most n * 2^53: no overflow
  for (std::size_t i = 0; i < n; ++i) {
    counts.push_back(static_cast<uint64_t>(f.integer(listed_counts[i], cat("counts[", i, "]"), 0, kMaxDataPosition)));
    sum += counts.back();
  }
  if (sum != cursor)
    r.damaged(cat("\"counts\" ", listed_counts.dump(), " sum to ", sum, " but \"cursor\" is ", cursor,
                  ": every global sample went to one dataset, the counts sum to the cursor"));
  // The blend's weights, normalised: one per dataset in [0, 1], summing to 1.
  const nlohmann::json& listed_weights = r.array("weights");
  if (listed_weights.size() != n)
    r.damaged(cat("\"weights\" has ", listed_weights.size(), " weight(s) for ", n,
                  " dataset(s) (\"datasets\"): one per dataset"));
  std::vector<double> weights;
  double wsum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    weights.push_back(f.number(listed_weights[i], cat("weights[", i, "]"), 0.0, 1.0));
    wsum += weights.back();
  }
  if (n > 0 && !(std::fabs(wsum - 1.0) <= 1e-6))
    r.damaged(cat("\"weights\" ", listed_weights.dump(), " sum to ", wsum, ": the blend's weights are kept "
                  "normalised, summing to 1"));

  bool same = n == train_.size();
  for (std::size_t i = 0; same && i < n; ++i)
    same = was[i].sequences == train_[i]->ds->sequences() && was[i].tokens == train_[i]->ds->tokens() &&
           was[i].begin == train_[i]->begin && was[i].end == train_[i]->end;
  if (!same) {
    std::string then, now;
    for (const Dataset& d : was) then += cat(" ", d.prefix, " (", d.tokens, " tokens)");
    for (auto& s : train_) now += cat(" ", s->ds->prefix(), " (", s->ds->tokens(), " tokens)");
    throw Error(cat("the data changed since the checkpoint: its Megatron datasets were", then, "; now they are", now,
                    " (or data.split moved the train documents); point data.prefix at the original datasets, or start "
                    "afresh (checkpoint.resume = \"none\")"));
  }
  if (seq_len != spec_.seq_len)
    throw Error(cat("the checkpoint's data position counts samples of seq_len ", seq_len, " but train.seq_len is now ",
                    spec_.seq_len, "; resume with train.seq_len = ", seq_len,
                    ", or start afresh (checkpoint.resume = \"none\")"));
  if (weights != weights_)
    log_warn("megatron: data.weights changed since the checkpoint; the blend continues from the checkpoint's counts with the new weights");
  if (shuffle != opt_.shuffle)
    log_warn(cat("megatron: the checkpoint was taken with shuffle = ", shuffle, ", the run now has shuffle = ",
                 opt_.shuffle, "; continuing from the same sample counts in the new order"));
  cursor_ = cursor;
  counts_ = counts;
  if (at.seed != seed_) {
    log_info(cat("megatron: continuing the checkpoint's sample order (seed ", at.seed, ", not the run's seed ", seed_, ")"));
    seed_ = at.seed;
    for (auto& s : train_) {
      s->doc_seed = hash_of(seed_, 0x444f4353ull, s->dataset);
      s->sample_seed = hash_of(seed_, 0x53414d50ull, s->dataset);
      s->epoch = -1;
    }
  }
  DataStateReader::note_reshard("megatron", at, spec_.world, spec_.batch, "sample");
  val_cursor_ = 0;
}

}  // namespace loom::data
