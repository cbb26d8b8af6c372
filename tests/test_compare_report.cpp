// The report of `loom compare`: loss differences, the text table, the CSV
// files read back, and the PNG chart decoded by an independent reader written
// here (bitwise CRC-32, plain Adler-32, stored-block inflate), so that the
// encoder is not checked against itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "canvas.hpp"
#include "compare_report.hpp"
#include "loom/error.hpp"
#include "png_writer.hpp"
#include "test_util.hpp"

using loom::report::Canvas;
using loom::report::CompareRow;
using loom::report::Rgb;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

CompareRow make_row(const std::string& label, std::vector<double> losses) {
  CompareRow r;
  r.label = label;
  r.losses = std::move(losses);
  if (!r.losses.empty()) r.final_loss = r.losses.back();
  return r;
}

// Three runs of 50 steps with distinct throughput and memory, as compare fills them.
std::vector<CompareRow> three_runs() {
  std::vector<CompareRow> rows;
  const char* labels[] = {"none", "ddp", "zero3"};
  for (int i = 0; i < 3; ++i) {
    std::vector<double> losses;
    for (int s = 0; s < 50; ++s) losses.push_back(8.0 * std::exp(-s / 15.0) + 2.0 + 0.05 * i);
    CompareRow r = make_row(labels[i], losses);
    r.ranks = i == 0 ? 1 : 4;
    r.step_ms = 100.0 + 20 * i;
    r.tokens_per_s_per_gpu = 40000.0 - 10000 * i;
    r.peak_mem_bytes = (6.0 - 2 * i) * kGiB;
    r.planned_mem_bytes = r.peak_mem_bytes * 0.9;
    r.bytes_per_step = {1e6 * i, 2e6 * i, 3e6 * i, 4e3, 5e5 * i};
    rows.push_back(r);
  }
  loom::report::compute_diffs(rows);
  return rows;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f) << path;
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// ---------------------------------------------------------------------------
// A CSV reader (RFC 4180 quoting, quoted fields may hold commas, quotes and
// newlines), independent of the writer.
// ---------------------------------------------------------------------------
std::vector<std::vector<std::string>> parse_csv(const std::string& text) {
  std::vector<std::vector<std::string>> records(1);
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      records.back().push_back(field);
      field.clear();
    } else if (c == '\n') {
      records.back().push_back(field);
      field.clear();
      records.emplace_back();
    } else {
      field += c;
    }
  }
  if (records.back().empty() && field.empty()) records.pop_back();  // the final newline
  return records;
}

double number(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  EXPECT_EQ(end, s.c_str() + s.size()) << "not a number: '" << s << "'";
  return v;
}

// ---------------------------------------------------------------------------
// A PNG reader for what the encoder writes: 8-bit RGB, stored deflate blocks.
// ---------------------------------------------------------------------------
uint32_t bitwise_crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t plain_adler32(const std::vector<uint8_t>& data) {
  uint32_t a = 1, b = 0;
  for (uint8_t x : data) {
    a = (a + x) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}
uint32_t le16(const uint8_t* p) { return p[0] | (uint32_t(p[1]) << 8); }

struct Image {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Rgb at(int x, int y) const {
    const size_t i = (size_t(y) * width + x) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2]};
  }
};

// Checks the zlib header, inflates the stored blocks and checks the Adler-32.
void inflate_stored(const std::vector<uint8_t>& z, std::vector<uint8_t>* out) {
  ASSERT_GE(z.size(), 2u + 5u + 4u);
  EXPECT_EQ(z[0] & 0x0F, 8) << "compression method must be deflate";
  EXPECT_EQ((z[0] * 256 + z[1]) % 31, 0) << "zlib header check bits";
  EXPECT_EQ(z[1] & 0x20, 0) << "no preset dictionary";
  size_t at = 2;
  for (bool final = false; !final;) {
    ASSERT_LE(at + 5, z.size());
    final = z[at] & 1;
    ASSERT_EQ((z[at] >> 1) & 3, 0) << "only stored blocks expected";
    const uint32_t len = le16(&z[at + 1]), nlen = le16(&z[at + 3]);
    ASSERT_EQ(len ^ 0xFFFFu, nlen) << "LEN and NLEN must be complements";
    at += 5;
    ASSERT_LE(at + len, z.size());
    out->insert(out->end(), z.begin() + at, z.begin() + at + len);
    at += len;
  }
  ASSERT_EQ(at + 4, z.size()) << "Adler-32 must end the stream";
  EXPECT_EQ(be32(&z[at]), plain_adler32(*out));
}

void decode_png(const std::vector<uint8_t>& png, Image* img) {
  const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  ASSERT_GE(png.size(), 8u);
  ASSERT_TRUE(std::equal(signature, signature + 8, png.begin()));
  std::vector<std::string> types;
  std::vector<uint8_t> idat;
  for (size_t at = 8; at < png.size();) {
    ASSERT_LE(at + 12, png.size());
    const uint32_t len = be32(&png[at]);
    ASSERT_LE(at + 12 + len, png.size());
    const std::string type(png.begin() + at + 4, png.begin() + at + 8);
    const uint8_t* data = &png[at + 8];
    EXPECT_EQ(be32(data + len), bitwise_crc32(&png[at + 4], 4 + len)) << "CRC of chunk " << type;
    types.push_back(type);
    if (type == "IHDR") {
      ASSERT_EQ(len, 13u);
      img->width = be32(data);
      img->height = be32(data + 4);
      EXPECT_EQ(data[8], 8) << "bit depth";
      EXPECT_EQ(data[9], 2) << "colour type RGB";
      EXPECT_EQ(data[10] | data[11] | data[12], 0) << "compression, filter, interlace";
    } else if (type == "IDAT") {
      idat.insert(idat.end(), data, data + len);
    } else if (type == "IEND") {
      EXPECT_EQ(len, 0u);
    }
    at += 12 + len;
  }
  ASSERT_FALSE(types.empty());
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");

  std::vector<uint8_t> raw;
  ASSERT_NO_FATAL_FAILURE(inflate_stored(idat, &raw));
  const size_t row = size_t(img->width) * 3;
  ASSERT_EQ(raw.size(), img->height * (row + 1));
  for (size_t y = 0; y < img->height; ++y) {
    ASSERT_EQ(raw[y * (row + 1)], 0) << "filter type of row " << y;
    img->rgb.insert(img->rgb.end(), raw.begin() + y * (row + 1) + 1, raw.begin() + (y + 1) * (row + 1));
  }
}

void decode_png_file(const std::string& path, Image* img) {
  const std::string bytes = read_text(path);
  ASSERT_NO_FATAL_FAILURE(decode_png(std::vector<uint8_t>(bytes.begin(), bytes.end()), img));
}

// Writes rows as a PNG, decodes it and checks it is the rendered chart, pixel for pixel.
void write_and_check_png(const std::string& path, const std::vector<CompareRow>& rows, const std::string& title) {
  loom::report::write_png(path, rows, title);
  Image img;
  ASSERT_NO_FATAL_FAILURE(decode_png_file(path, &img));
  const auto chart = loom::report::render_chart(rows, title);
  EXPECT_EQ(img.width, 1200u);
  EXPECT_EQ(img.height, 800u);
  EXPECT_TRUE(img.rgb == chart.canvas.rgb()) << "decoded pixels differ from the rendered chart";
}

// ---------------------------------------------------------------------------
// compute_diffs
// ---------------------------------------------------------------------------
TEST(CompareReport, DiffsOverCommonSteps) {
  std::vector<CompareRow> rows = {make_row("ref", {2.0, 1.5, 1.0}), make_row("b", {2.0, 1.6, 0.9, 0.1}),
                                  make_row("same", {2.0, 1.5, 1.0})};
  loom::report::compute_diffs(rows);
  EXPECT_EQ(rows[0].max_loss_diff, 0.0);
  EXPECT_EQ(rows[0].max_rel_loss_diff, 0.0);
  // Step 4 of "b" has no counterpart in the reference and is ignored.
  EXPECT_NEAR(rows[1].max_loss_diff, 0.1, 1e-12);
  EXPECT_NEAR(rows[1].max_rel_loss_diff, 0.1 / 1.0, 1e-12);  // 0.1/1.5 at step 2 is smaller
  EXPECT_EQ(rows[2].max_loss_diff, 0.0);
  EXPECT_EQ(rows[2].max_rel_loss_diff, 0.0);
}

TEST(CompareReport, DiffsOfDivergedAndFailedRuns) {
  std::vector<CompareRow> rows = {make_row("ref", {3.0, kNaN, 2.0}), make_row("nan-too", {3.5, kNaN, 2.0}),
                                  make_row("diverged", {3.0, 2.5, kInf}), make_row("failed", {})};
  loom::report::compute_diffs(rows);
  EXPECT_DOUBLE_EQ(rows[1].max_loss_diff, 0.5);  // the step where both are NaN is skipped
  EXPECT_DOUBLE_EQ(rows[1].max_rel_loss_diff, 0.5 / 3.0);
  EXPECT_TRUE(std::isinf(rows[2].max_loss_diff));  // inf where the reference is finite
  EXPECT_TRUE(std::isinf(rows[2].max_rel_loss_diff));
  EXPECT_TRUE(std::isnan(rows[3].max_loss_diff));  // nothing to compare
  EXPECT_TRUE(std::isnan(rows[3].max_rel_loss_diff));

  std::vector<CompareRow> zero = {make_row("ref", {1.0, 0.0}), make_row("b", {1.0, 0.5})};
  loom::report::compute_diffs(zero);
  EXPECT_DOUBLE_EQ(zero[1].max_loss_diff, 0.5);      // against a reference loss of 0 ...
  EXPECT_TRUE(std::isinf(zero[1].max_rel_loss_diff));  // ... the relative difference is infinite
  std::vector<CompareRow> none;
  loom::report::compute_diffs(none);  // no rows: nothing to do, no crash
}

// ---------------------------------------------------------------------------
// Numbers and the table
// ---------------------------------------------------------------------------
TEST(CompareReport, HumanNumbers) {
  using namespace loom::report;
  EXPECT_EQ(format_count(850), "850");
  EXPECT_EQ(format_count(12345), "12.3K");
  EXPECT_EQ(format_count(123456), "123K");
  EXPECT_EQ(format_count(999999), "1.00M");  // rounding moves it to the next unit
  EXPECT_EQ(format_count(kNaN), "-");
  EXPECT_EQ(format_bytes_binary(512), "512 B");
  EXPECT_EQ(format_bytes_binary(512 * kMiB), "512 MiB");
  EXPECT_EQ(format_bytes_binary(2.5 * kGiB), "2.50 GiB");
  EXPECT_EQ(format_bytes_decimal(0), "0 B");
  EXPECT_EQ(format_bytes_decimal(2.5e8), "250 MB");
  EXPECT_EQ(format_bytes_decimal(1.5e9), "1.50 GB");
}

TEST(CompareReport, TableHasEveryLabelAndFormattedNumbers) {
  auto rows = three_runs();
  rows.push_back(make_row("broken", {}));
  rows.back().note = "out of memory\nat step 1";
  loom::report::compute_diffs(rows);
  const std::string t = loom::report::format_table(rows);
  for (const auto& r : rows) EXPECT_NE(t.find(r.label), std::string::npos) << r.label;
  for (const char* s : {"label", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "100.0 ms", "120.0 ms",
                        "40.0K tok/s", "20.0K tok/s", "6.00 GiB", "2.00 GiB", "5.40 GiB", "2.00 MB", "6.00 MB",
                        "4.00 KB", "1.00 MB", "out of memory at step 1", "against 'none'"})
    EXPECT_NE(t.find(s), std::string::npos) << "missing '" << s << "' in:\n" << t;
  // The final loss of the reference, 8 exp(-49/15) + 2 = 2.30508...
  EXPECT_NE(t.find("2.3051"), std::string::npos) << t;
  // "ddp" differs from "none" by 0.05 at every step.
  EXPECT_NE(t.find("5.00e-02"), std::string::npos) << t;
  // The failed run has no final loss and nothing to compare: three "-" cells.
  const size_t at = t.find("\nbroken") + 1;
  std::istringstream line(t.substr(at, t.find('\n', at) - at));
  int dashes = 0;
  for (std::string cell; line >> cell;) dashes += cell == "-";
  EXPECT_EQ(dashes, 3) << t;
}

TEST(CompareReport, TableColumnsAreAligned) {
  const auto rows = three_runs();
  std::istringstream in(loom::report::format_table(rows));
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_GE(lines.size(), 2 + rows.size());
  EXPECT_EQ(lines[1].find_first_not_of('-'), std::string::npos) << "a rule under the header";
  // Numbers are right-aligned: every cell of the step column ends where its header does.
  const size_t step_end = lines[0].find("step") + 4;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string& l = lines[2 + i];
    EXPECT_EQ(l.substr(0, rows[i].label.size()), rows[i].label);
    EXPECT_EQ(l.substr(step_end - 2, 2), "ms") << l;
  }
}

// ---------------------------------------------------------------------------
// CSV
// ---------------------------------------------------------------------------
TEST(CompareReport, CsvReadsBackTheSameNumbers) {
  loom::test::TmpDir dir;
  auto rows = three_runs();
  rows[1].label = "ddp, bucketed";               // needs quoting
  rows[2].note = "peer said \"no\"\nthen left";  // quotes and a newline
  rows[2].losses[10] = kNaN;
  rows[2].losses.resize(40);  // shorter than the others
  rows[0].step_ms = 0.1 + 0.2;  // not exactly representable in few digits
  rows.push_back(make_row("failed", {}));
  loom::report::compute_diffs(rows);
  const std::string path = dir.str() + "/cmp.csv";
  loom::report::write_csv(path, rows);

  const auto summary = parse_csv(read_text(path));
  ASSERT_EQ(summary.size(), rows.size() + 1);
  const std::vector<std::string> header = {"label", "ranks", "step_ms", "tokens_per_s_per_gpu", "peak_mem_bytes",
                                           "planned_mem_bytes", "all_reduce_bytes_per_step",
                                           "reduce_scatter_bytes_per_step", "all_gather_bytes_per_step",
                                           "broadcast_bytes_per_step", "all_to_all_bytes_per_step", "steps",
                                           "final_loss", "max_loss_diff",
                                           "max_rel_loss_diff", "note", "model_tflops", "mfu"};
  EXPECT_EQ(summary[0], header);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    const auto& f = summary[i + 1];
    ASSERT_EQ(f.size(), header.size()) << "line " << i + 2;
    EXPECT_EQ(f[0], r.label);
    EXPECT_EQ(number(f[1]), r.ranks);
    EXPECT_EQ(number(f[2]), r.step_ms);
    EXPECT_EQ(number(f[3]), r.tokens_per_s_per_gpu);
    EXPECT_EQ(number(f[4]), r.peak_mem_bytes);
    EXPECT_EQ(number(f[5]), r.planned_mem_bytes);
    for (int c = 0; c < 5; ++c) EXPECT_EQ(number(f[6 + c]), r.bytes_per_step[c]);
    EXPECT_EQ(number(f[11]), double(r.losses.size()));
    EXPECT_EQ(number(f[12]), r.final_loss);
    for (int c : {13, 14}) {
      const double want = c == 13 ? r.max_loss_diff : r.max_rel_loss_diff;
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(number(f[c]))) << f[c];
      else EXPECT_EQ(number(f[c]), want);
    }
    EXPECT_EQ(f[15], r.note);
  }

  const auto losses = parse_csv(read_text(dir.str() + "/cmp_losses.csv"));
  ASSERT_EQ(losses.size(), 1 + 50u);
  EXPECT_EQ(losses[0], (std::vector<std::string>{"step", "none", "ddp, bucketed", "zero3", "failed"}));
  for (size_t s = 0; s < 50; ++s) {
    const auto& f = losses[s + 1];
    ASSERT_EQ(f.size(), 5u);
    EXPECT_EQ(number(f[0]), double(s + 1));
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& l = rows[i].losses;
      if (s >= l.size()) EXPECT_EQ(f[i + 1], "") << "step " << s + 1 << " of " << rows[i].label;
      else if (std::isnan(l[s])) EXPECT_TRUE(std::isnan(number(f[i + 1])));
      else EXPECT_EQ(number(f[i + 1]), l[s]);
    }
  }
}

TEST(CompareReport, LossesCsvPathFollowsTheSummary) {
  EXPECT_EQ(loom::report::losses_csv_path("out/cmp.csv"), "out/cmp_losses.csv");
  EXPECT_EQ(loom::report::losses_csv_path("cmp"), "cmp_losses.csv");
}

TEST(CompareReport, WriteErrorsNameThePath) {
  loom::test::TmpDir dir;
  const std::string csv = dir.str() + "/missing/cmp.csv";
  const std::string png = dir.str() + "/missing/cmp.png";
  loom::test::expect_error([&] { loom::report::write_csv(csv, three_runs()); }, {csv});
  loom::test::expect_error([&] { loom::report::write_png(png, three_runs(), "t"); }, {png});
}

// ---------------------------------------------------------------------------
// PNG
// ---------------------------------------------------------------------------
TEST(CompareReport, ChecksumsMatchTheirStandardCheckValues) {
  const std::string digits = "123456789", wiki = "Wikipedia";
  EXPECT_EQ(loom::png::crc32({reinterpret_cast<const uint8_t*>(digits.data()), digits.size()}), 0xCBF43926u);
  EXPECT_EQ(loom::png::adler32({reinterpret_cast<const uint8_t*>(wiki.data()), wiki.size()}), 0x11E60398u);
}

TEST(CompareReport, EncoderRoundTripsSmallImages) {
  const std::vector<uint8_t> rgb = {255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30};  // 2x2
  Image img;
  ASSERT_NO_FATAL_FAILURE(decode_png(loom::png::encode_rgb(2, 2, rgb), &img));
  EXPECT_EQ(img.width, 2u);
  EXPECT_EQ(img.height, 2u);
  EXPECT_EQ(img.rgb, rgb);
  loom::test::expect_error([&] { loom::png::encode_rgb(3, 2, rgb); }, {"3x2", "18 bytes", "got 12"});
  loom::test::expect_error([&] { loom::png::encode_rgb(0, 2, {}); }, {"0x2"});
}

TEST(CompareReport, PngChartHasBarsInRowColours) {
  loom::test::TmpDir dir;
  const auto rows = three_runs();
  const std::string path = dir.str() + "/cmp.png";
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, rows, "compare: 3 strategies"));
  Image img;
  ASSERT_NO_FATAL_FAILURE(decode_png_file(path, &img));
  const auto chart = loom::report::render_chart(rows, "compare: 3 strategies");
  ASSERT_EQ(chart.throughput_bars.size(), rows.size());
  ASSERT_EQ(chart.memory_bars.size(), rows.size());
  for (const auto* bars : {&chart.throughput_bars, &chart.memory_bars}) {
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& b = (*bars)[i];
      ASSERT_GT(b.h, 20) << "bar " << i;
      EXPECT_EQ(img.at(b.cx(), b.cy()), loom::report::row_color(i)) << "centre of bar " << i;
      // Between this bar and the next (or past the last), at mid height: background.
      EXPECT_EQ(img.at(b.x + b.w + 3, b.cy()), loom::report::kBackground) << "right of bar " << i;
    }
    // Bars scale with their values: the first row's is the tallest.
    EXPECT_GT((*bars)[0].h, (*bars)[1].h);
    EXPECT_GT((*bars)[1].h, (*bars)[2].h);
  }
  EXPECT_EQ(img.at(3, 3), loom::report::kBackground);
  EXPECT_EQ(img.at(1196, 796), loom::report::kBackground);
  // Each loss curve leaves a trail of its colour in the loss plot, more than its legend swatch.
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& p = chart.loss_plot;
    int n = 0;
    for (int y = p.y; y < p.y + p.h; ++y)
      for (int x = p.x; x < p.x + p.w; ++x) n += img.at(x, y) == loom::report::row_color(i);
    EXPECT_GT(n, 300) << "curve of row " << i;
  }
}

TEST(CompareReport, PngEdgeCasesRender) {
  loom::test::TmpDir dir;
  const std::string path = dir.str() + "/edge.png";
  auto rows = three_runs();

  // A single row, and a single row of a single step.
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {rows[0]}, "one row"));
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {make_row("one-step", {2.5})}, "one step"));
  // NaN and inf losses are skipped, even when a run has nothing else.
  auto bad = rows;
  bad[1].losses[5] = kNaN;
  bad[2].losses[7] = kInf;
  bad[2].losses[8] = -kInf;
  bad.push_back(make_row("all-nan", {kNaN, kNaN}));
  loom::report::compute_diffs(bad);
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, bad, "non-finite losses"));
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {make_row("nan", {kNaN})}, "only NaN"));
  // All losses equal: no zero y-range.
  ASSERT_NO_FATAL_FAILURE(
      write_and_check_png(path, {make_row("a", {2.0, 2.0, 2.0}), make_row("b", {2.0, 2.0})}, "flat"));
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {make_row("zero", {0.0, 0.0})}, "flat at zero"));
  // No rows at all, a long non-ASCII title and label, many rows.
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {}, "nothing"));
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, {make_row(std::string(80, 'x') + "\xc3\xa9", {1.0, 2.0})},
                                              std::string(300, 'T') + "\xe2\x9c\x93"));
  std::vector<CompareRow> many;
  for (int i = 0; i < 40; ++i) many.push_back(make_row("run" + std::to_string(i), {1.0 + i, 0.5 + i}));
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(path, many, "forty rows"));
}

TEST(CompareReport, FailedRunHasEmptyBars) {
  loom::test::TmpDir dir;
  auto rows = three_runs();
  CompareRow failed = make_row("oom", {});
  failed.tokens_per_s_per_gpu = 123;  // measured before failing: still drawn as 0
  failed.peak_mem_bytes = 80 * kGiB;
  failed.note = "out of memory";
  rows.insert(rows.begin() + 1, failed);
  loom::report::compute_diffs(rows);
  ASSERT_NO_FATAL_FAILURE(write_and_check_png(dir.str() + "/failed.png", rows, "with a failure"));
  const auto chart = loom::report::render_chart(rows, "with a failure");
  EXPECT_EQ(chart.throughput_bars[1].h, 0);
  EXPECT_EQ(chart.memory_bars[1].h, 0);
  // The other bars keep their scale: 80 GiB of the failed run does not shrink them.
  EXPECT_GT(chart.memory_bars[0].h, 100);
}

TEST(CompareReport, CanvasLinesAndText) {
  Canvas c(20, 10, {0, 0, 0});
  const Rgb red{255, 0, 0};
  c.line(1, 1, 15, 7, red);
  EXPECT_EQ(c.at(1, 1), red);
  EXPECT_EQ(c.at(15, 7), red);
  c.line(2, 9, 18, 9, red, 3);  // clipped at the bottom edge without harm
  EXPECT_EQ(c.at(10, 8), red);
  EXPECT_EQ(c.at(10, 9), red);
  EXPECT_EQ(Canvas::text_width("ab", 2), (2 * 6 - 1) * 2);
  EXPECT_EQ(Canvas::text_height(3), 21);
  c.text(-5, -5, "clipped \x01", red, 4);  // off-canvas and unprintable: no crash
}

}  // namespace

// --peer files: the rows of benchmarks/torch_fsdp.py and hf_llama.py (with
// or without the PEER_JSON prefix, among log lines) are read; a file with no
// row (a TOML file, say) and a row without what a peer row holds are refused
// naming the file, the line and what is missing, instead of being passed over
// or read as a row of zeros.
TEST(CompareReport, PeerRowsAreReadAndAnythingElseIsRefused) {
  loom::test::TmpDir d;
  auto file = [&](const std::string& name, const std::string& text) {
    const std::string p = (d.path / name).string();
    std::ofstream(p) << text;
    return p;
  };
  const std::string good = file(
      "good.txt",
      "torch_fsdp.py: starting\n"
      "PEER_JSON {\"peer\": \"torch_fsdp\", \"mode\": \"fsdp2\", \"world\": 2, \"median_step_ms\": 100.0, "
      "\"tokens_per_s_per_gpu\": 5000.0, \"peak_reserved_bytes\": 1e9, \"losses\": [3.0, null, 2.5], \"final_loss\": 2.5}\n"
      "{\"peer\": \"hf_transformers\", \"mode\": \"eager\", \"median_step_ms\": 50, \"tokens_per_s\": 8000}\n"
      "PEER_JSON {\"mode\": \"compile\", \"error\": \"OutOfMemoryError: CUDA\"}\n");
  const std::vector<CompareRow> rows = loom::report::read_peer_rows(good);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].label, "torch fsdp2");
  EXPECT_EQ(rows[0].ranks, 2);
  EXPECT_DOUBLE_EQ(rows[0].step_ms, 100.0);
  EXPECT_DOUBLE_EQ(rows[0].tokens_per_s_per_gpu, 5000.0);
  EXPECT_DOUBLE_EQ(rows[0].peak_mem_bytes, 1e9);
  ASSERT_EQ(rows[0].losses.size(), 3u);
  EXPECT_TRUE(std::isnan(rows[0].losses[1]));
  EXPECT_DOUBLE_EQ(rows[0].final_loss, 2.5);
  EXPECT_EQ(rows[1].label, "torch eager");
  EXPECT_DOUBLE_EQ(rows[1].tokens_per_s_per_gpu, 8000.0);  // tokens_per_s of a world of one
  EXPECT_TRUE(rows[2].failed());
  EXPECT_NE(rows[2].note.find("peer failed: \"OutOfMemoryError: CUDA\""), std::string::npos);

  const std::string toml = file("c.toml", "[run]\nname = \"x\"\n[model]\nhidden = 32\n");
  loom::test::expect_error([&] { loom::report::read_peer_rows(toml); },
                           {"--peer=" + toml + ": holds no peer rows: expected a PEER_JSON row of benchmarks/torch_fsdp.py"});
  loom::test::expect_error([&] { loom::report::read_peer_rows(file("empty.json", "")); }, {"holds no peer rows"});
  struct Bad { std::string row, says; };
  for (const Bad& b : std::vector<Bad>{
           {"{\"garbage\": 1}", "\"median_step_ms\" is missing"},
           {"{\"median_step_ms\": 10}", "\"tokens_per_s_per_gpu\" (or \"tokens_per_s\") is missing"},
           {"{\"median_step_ms\": \"fast\", \"tokens_per_s\": 1}", "\"median_step_ms\" is \"fast\", not a number"},
           {"{\"median_step_ms\": 0, \"tokens_per_s\": 1}", "\"median_step_ms\" is 0, not a positive time"},
           {"{\"median_step_ms\": 1, \"tokens_per_s\": 1, \"losses\": 3}", "\"losses\" is 3, not an array"},
           {"{\"median_step_ms\": 1, \"tokens_per_s\": 1, \"losses\": [\"x\"]}", "\"losses\" holds \"x\", not a number"},
           {"{\"median_step_ms\": 1, \"tokens_per_s\": 1, \"world\": 0}", "\"world\" is 0, not a number of ranks"},
           {"{\"median_step_ms\": 1, \"tokens_per_s\": 1, \"mode\": 7}", "\"mode\" is 7, not a string"},
           {"PEER_JSON [1, 2]", "it is [1,2], not an object"},
           {"PEER_JSON", "not a JSON object"},
           {"{nope", "not a JSON object"}}) {
    SCOPED_TRACE(b.row);
    const std::string p = file("bad.json", "log line\n" + b.row + "\n");
    loom::test::expect_error([&] { loom::report::read_peer_rows(p); }, {"--peer=" + p + ":2: ", b.says});
  }
}

