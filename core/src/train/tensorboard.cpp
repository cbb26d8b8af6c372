#include "train/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "loom/error.hpp"

namespace loom {
namespace {

std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;  // Castagnoli, reflected
    t[i] = c;
  }
  return t;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void bytes_field(std::string& out, int field, std::string_view b) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, b.size());
  out += b;
}

template <typename T>
void fixed(std::string& out, int field, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
  varint(out, static_cast<uint64_t>(field) << 3 | (sizeof(T) == 8 ? 1 : 5));
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // protobuf's fixed types are little-endian, as is the host
  out.append(b, sizeof(T));
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event(double wall, int64_t step, const std::string* version, const std::string* summary,
                  const std::string* session_log = nullptr) {
  std::string e;
  fixed(e, 1, wall);
  varint(e, 2 << 3 | 0);
  varint(e, static_cast<uint64_t>(step));
  if (version) bytes_field(e, 3, *version);
  if (summary) bytes_field(e, 5, *summary);
  if (session_log) bytes_field(e, 7, *session_log);
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, std::size_t n) {
  static const std::array<uint32_t, 256> table = crc_table();
  uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t resume_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(cat("cannot create the TensorBoard directory '", dir, "': ", ec.message(), "; check run.out_dir"));
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  const std::string base = (std::filesystem::path(dir) / cat("events.out.tfevents.", static_cast<int64_t>(now_s()), ".",
                                                             host, ".", getpid(), ".loom")).string();
  // Exclusive: a second writer in the same second and process (a resume in
  // the same process) must not truncate the first one's file. The suffix
  // sorts after the bare name, so TensorBoard still reads them in order.
  for (int n = 0; !f_; ++n) {
    path_ = n == 0 ? base : cat(base, ".", n);
    f_ = std::fopen(path_.c_str(), "wbx");
    if (!f_ && (errno != EEXIST || n >= 99))
      throw Error(cat("cannot create the TensorBoard event file '", path_, "': ", std::strerror(errno)));
  }
  const std::string version = "brain.Event:2";
  record(event(now_s(), 0, &version, nullptr));
  std::string start;
  varint(start, 1 << 3 | 0);  // SessionLog.status
  varint(start, 1);           // START
  record(event(now_s(), resume_step > 0 ? resume_step + 1 : 0, nullptr, nullptr, &start));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::record(const std::string& payload) {
  const uint64_t len = payload.size();
  char head[12];
  std::memcpy(head, &len, 8);
  const uint32_t lcrc = masked(crc32c(head, 8));
  std::memcpy(head + 8, &lcrc, 4);
  const uint32_t pcrc = masked(crc32c(payload.data(), payload.size()));
  // Flushed per record: TensorBoard reads the file while the run goes on,
  // and a crash loses at most the record being written.
  if (std::fwrite(head, 1, 12, f_) != 12 || std::fwrite(payload.data(), 1, payload.size(), f_) != payload.size() ||
      std::fwrite(&pcrc, 1, 4, f_) != 4 || std::fflush(f_) != 0)
    throw Error(cat("cannot write the TensorBoard event file '", path_, "': ", std::strerror(errno),
                    "; check free disk space"));
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    fixed(value, 2, static_cast<float>(v));
    bytes_field(summary, 1, value);
  }
  record(event(now_s(), step, nullptr, &summary));
}

void TensorBoardWriter::step(const StepLog& s) {
  std::vector<std::pair<std::string, double>> v = {
      {"train/loss", s.loss},           {"train/lr", s.lr},         {"train/grad_norm", s.grad_norm},
      {"perf/tokens_per_s", s.tokens_per_s}, {"perf/samples_per_s", s.samples_per_s}, {"perf/step_ms", s.step_ms}};
  if (s.peak_mem_bytes > 0) v.emplace_back("perf/memory_gib", static_cast<double>(s.peak_mem_bytes) / (1024.0 * 1024.0 * 1024.0));
  if (s.mfu > 0) v.emplace_back("perf/mfu", s.mfu);
  if (s.has_aux) v.emplace_back("train/aux_loss", s.aux_loss);
  if (s.has_val) v.emplace_back("val/loss", s.val_loss);
  for (const auto& [name, x] : s.extras) v.emplace_back("extra/" + name, x);
  scalars(s.step, v);
}

}  // namespace loom
