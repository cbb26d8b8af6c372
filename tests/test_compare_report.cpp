// The report of `loom compare`: loss differences, the text table, the CSV
// files read back, and the PNG chart decoded by a reader written here (zlib's
// inflate, bitwise CRC-32, the five row filters), independent of libpng, which
// cairo writes the file with; and the drawing layer the charts are made of.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <zlib.h>

#include "compare_report.hpp"
#include "loom/error.hpp"
#include "test_util.hpp"

using loom::report::Drawing;
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
// A PNG reader for what the charts are: 8-bit RGB, not interlaced.
// ---------------------------------------------------------------------------
uint32_t bitwise_crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}

struct Image {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Rgb at(int x, int y) const {
    const size_t i = (size_t(y) * width + x) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2]};
  }
};

// The zlib stream inflated to exactly `size` bytes (zlib checks the Adler-32).
void inflate_all(const std::vector<uint8_t>& z, size_t size, std::vector<uint8_t>* out) {
  out->assign(size + 1, 0);  // one spare byte: a longer stream is caught
  uLongf n = out->size();
  ASSERT_EQ(uncompress(out->data(), &n, z.data(), z.size()), Z_OK) << "IDAT is not one zlib stream";
  ASSERT_EQ(n, size) << "inflated IDAT size";
  out->resize(n);
}

// PNG's filter types 0..4 undone on one row (3 bytes a pixel): a is the
// byte to the left, b the one above, c the one above and to the left.
void unfilter(uint8_t type, uint8_t* row, const uint8_t* above, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const int a = i >= 3 ? row[i - 3] : 0, b = above[i], c = i >= 3 ? above[i - 3] : 0;
    int pred = 0;
    switch (type) {
      case 0: break;
      case 1: pred = a; break;
      case 2: pred = b; break;
      case 3: pred = (a + b) / 2; break;
      case 4: {
        const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
        pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
        break;
      }
      default: FAIL() << "filter type " << int(type);
    }
    row[i] = static_cast<uint8_t>(row[i] + pred);
  }
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

  const size_t row = size_t(img->width) * 3;
  std::vector<uint8_t> raw;
  ASSERT_NO_FATAL_FAILURE(inflate_all(idat, img->height * (row + 1), &raw));
  const std::vector<uint8_t> zeros(row, 0);
  for (size_t y = 0; y < img->height; ++y) {
    uint8_t* line = &raw[y * (row + 1) + 1];
    ASSERT_NO_FATAL_FAILURE(unfilter(line[-1], line, y == 0 ? zeros.data() : line - (row + 1), row));
    img->rgb.insert(img->rgb.end(), line, line + row);
  }
}

void decode_png_file(const std::string& path, Image* img) {
  const std::string bytes = read_text(path);
  ASSERT_NO_FATAL_FAILURE(decode_png(std::vector<uint8_t>(bytes.begin(), bytes.end()), img));
}

// Pixels within `tol` of colour c in every channel: antialiased lines keep c
// exactly only where they cover a whole pixel, and their edges blend.
bool near(Rgb a, Rgb c, int tol) {
  return std::abs(a.r - c.r) <= tol && std::abs(a.g - c.g) <= tol && std::abs(a.b - c.b) <= tol;
}

// Writes rows as a PNG, decodes it and checks it is the rendered chart, pixel for pixel.
void write_and_check_png(const std::string& path, const std::vector<CompareRow>& rows, const std::string& title) {
  loom::report::write_png(path, rows, title);
  Image img;
  ASSERT_NO_FATAL_FAILURE(decode_png_file(path, &img));
  const auto chart = loom::report::render_chart(rows, title);
  EXPECT_EQ(img.width, 1200u);
  EXPECT_EQ(img.height, 800u);
  EXPECT_TRUE(img.rgb == chart.drawing.rgb()) << "decoded pixels differ from the rendered chart";
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
  // tests/metrics/check_png.py (Python's zlib and its own unfiltering, what
  // the `loom plot` tests run) passes the file and decodes the same pixels.
  const std::string raw = dir.str() + "/cmp.rgb", log = dir.str() + "/check_png.log";
  const int rc = std::system(loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/metrics/check_png.py ", path,
                                       " 1200 800 --raw ", raw, " > ", log, " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << read_text(log);
  const std::string py = read_text(raw);
  EXPECT_TRUE(std::vector<uint8_t>(py.begin(), py.end()) == img.rgb) << "the two decoders disagree";
  // Each loss curve leaves a trail of its colour in the loss plot, more than
  // its legend swatch (66 pixels). The tolerance takes in the antialiased
  // edges and stays far from the other rows' colours (40 apart at least).
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& p = chart.loss_plot;
    int n = 0;
    for (int y = p.y; y < p.y + p.h; ++y)
      for (int x = p.x; x < p.x + p.w; ++x) n += near(img.at(x, y), loom::report::row_color(i), 16);
    EXPECT_GT(n, 300) << "curve of row " << i;
  }
  // The title is text: ink across the band above the plots, in many grey
  // levels (antialiased glyphs), centred on the page.
  std::set<int> greys;
  int ink = 0, left = 1200, right = 0;
  for (int y = 10; y < 50; ++y)
    for (int x = 0; x < 1200; ++x) {
      const Rgb c = img.at(x, y);
      if (c == loom::report::kBackground) continue;
      ++ink, left = std::min(left, x), right = std::max(right, x);
      if (c.r == c.g && c.g == c.b) greys.insert(c.r);
    }
  EXPECT_GT(ink, 200);
  EXPECT_GT(greys.size(), 16u);
  EXPECT_NEAR((left + right) / 2.0, 600, 4) << "title from x=" << left << " to " << right;
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

// ---------------------------------------------------------------------------
// The drawing layer
// ---------------------------------------------------------------------------
// Filled rectangles land on whole pixels with their exact colour, clipped at
// the edges, later ones over earlier ones: checked against a pixel array
// filled the same way, on random sizes and rectangles partly outside.
TEST(Drawing, FillsWholePixelsAsAReferenceArrayDoes) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> size(1, 60), byte(0, 255);
  for (int trial = 0; trial < 20; ++trial) {
    const int w = size(rng), h = size(rng);
    const Rgb bg{uint8_t(byte(rng)), uint8_t(byte(rng)), uint8_t(byte(rng))};
    Drawing d(w, h, bg);
    std::vector<Rgb> ref(size_t(w) * h, bg);
    for (int k = 0; k < 8; ++k) {
      std::uniform_int_distribution<int> xs(-20, w + 5), ys(-20, h + 5), ext(0, 40);
      const loom::report::Rect r{xs(rng), ys(rng), ext(rng), ext(rng)};
      const Rgb c{uint8_t(byte(rng)), uint8_t(byte(rng)), uint8_t(byte(rng))};
      d.fill(r, c);
      for (int y = std::max(r.y, 0); y < std::min(r.y + r.h, h); ++y)
        for (int x = std::max(r.x, 0); x < std::min(r.x + r.w, w); ++x) ref[size_t(y) * w + x] = c;
    }
    const std::vector<uint8_t> rgb = d.rgb();
    ASSERT_EQ(rgb.size(), size_t(w) * h * 3);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        const Rgb want = ref[size_t(y) * w + x];
        ASSERT_EQ(d.at(x, y), want) << "trial " << trial << " pixel " << x << "," << y;
        const size_t i = (size_t(y) * w + x) * 3;
        ASSERT_EQ((Rgb{rgb[i], rgb[i + 1], rgb[i + 2]}), want) << "rgb() at " << x << "," << y;
      }
    EXPECT_EQ(d.at(-1, 0), (Rgb{})) << "outside the image";
    EXPECT_EQ(d.at(w, h - 1), (Rgb{}));
  }
  loom::test::expect_error([] { Drawing(0, 5, {}); }, {"0x5"});
  loom::test::expect_error([] { Drawing(7, -1, {}); }, {"7x-1"});
}

// cairo is loaded, not linked: where it cannot be, the one message names the
// library, the loader's reason and what to do. A library that is not cairo
// is named with the call it lacks.
TEST(Drawing, AMissingCairoIsNamedWithWhatToDo) {
  EXPECT_NO_THROW(loom::report::require_cairo());
  loom::test::expect_error([] { loom::report::require_cairo("libcairo-not-here.so.2"); },
                           {"libcairo-not-here.so.2", "cannot open shared object file", "apt install libcairo2"});
  loom::test::expect_error([] { loom::report::require_cairo("libz.so.1"); },
                           {"libz.so.1 has no cairo_image_surface_create", "apt install libcairo2"});
}

// Text comes from a real, proportional font with antialiased glyphs: W is
// wider than i (a fixed-width bitmap font makes them equal), widths grow with
// the size, and the ink lies where the alignment puts it.
TEST(Drawing, TextIsProportionalAntialiasedAndWhereItIsAligned) {
  Drawing d(400, 100, loom::report::kBackground);
  EXPECT_GT(d.text_width("WWWW", 20), 2 * d.text_width("iiii", 20));
  for (const char* s : {"loss", "tokens/s per GPU", "0.0025"}) {
    const double w10 = d.text_width(s, 10), w30 = d.text_width(s, 30);
    EXPECT_NEAR(w30 / w10, 3.0, 0.3) << s;  // hinting rounds advances at small sizes
  }
  const double cap = d.cap_height(20);
  EXPECT_GT(cap, 10);  // capitals of a 20-pixel font are 13-15 pixels tall
  EXPECT_LT(cap, 18);
  for (auto align : {loom::report::Align::kLeft, loom::report::Align::kCenter, loom::report::Align::kRight}) {
    Drawing t(400, 100, loom::report::kBackground);
    const std::string s = "Validation 42";
    const double w = t.text_width(s, 20);
    t.text(200, 50, s, loom::report::kInk, 20, align);
    int left = 400, right = -1, top = 100, bottom = -1;
    std::set<int> levels;
    for (int y = 0; y < 100; ++y)
      for (int x = 0; x < 400; ++x)
        if (const Rgb c = t.at(x, y); !(c == loom::report::kBackground)) {
          left = std::min(left, x), right = std::max(right, x), top = std::min(top, y), bottom = std::max(bottom, y);
          levels.insert(c.r);
        }
    const double x0 = align == loom::report::Align::kLeft ? 200 : align == loom::report::Align::kCenter ? 200 - w / 2 : 200 - w;
    // Glyphs' side bearings keep the ink a pixel or two inside the advance.
    EXPECT_NEAR(left, x0, 3) << int(align);
    EXPECT_NEAR(right, x0 + w, 4) << int(align);
    EXPECT_NEAR(top, 50 - cap / 2, 2) << "the capitals' middle is on y";
    EXPECT_NEAR(bottom, 50 + cap / 2, 2) << "no descender in the text";
    EXPECT_GT(levels.size(), 8u) << "antialiased edges";
  }
}

// Run names and labels are bytes: each ill-formed UTF-8 sequence's bytes and
// each control character become U+FFFD, well-formed text is kept, and any
// bytes at all draw (cairo refuses invalid UTF-8 and then draws nothing more).
TEST(Drawing, AnyBytesDrawAsText) {
  using loom::report::printable;
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(printable("plain ascii"), "plain ascii");
  EXPECT_EQ(printable("z\xC3\xA9ro \xE2\x9C\x93 \xF0\x9F\x98\x80"), "z\xC3\xA9ro \xE2\x9C\x93 \xF0\x9F\x98\x80");
  EXPECT_EQ(printable("a\tb\x7F"), "a" + r + "b" + r);
  EXPECT_EQ(printable("\xC2\x85"), r);                  // C1 control (NEL)
  EXPECT_EQ(printable("\xC0\xAF"), r + r);              // overlong '/'
  EXPECT_EQ(printable("\xED\xA0\x80"), r + r + r);      // a surrogate
  EXPECT_EQ(printable("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(printable("\xE2\x82"), r + r);              // cut short
  EXPECT_EQ(printable("\xE2\x82x"), r + r + "x");

  // Random code points encoded by hand come back unchanged; random bytes draw.
  std::mt19937 rng(11);
  auto encode = [](uint32_t cp) {
    std::string s;
    if (cp < 0x80) s += char(cp);
    else if (cp < 0x800) s += char(0xC0 | cp >> 6), s += char(0x80 | (cp & 0x3F));
    else if (cp < 0x10000) s += char(0xE0 | cp >> 12), s += char(0x80 | (cp >> 6 & 0x3F)), s += char(0x80 | (cp & 0x3F));
    else s += char(0xF0 | cp >> 18), s += char(0x80 | (cp >> 12 & 0x3F)), s += char(0x80 | (cp >> 6 & 0x3F)), s += char(0x80 | (cp & 0x3F));
    return s;
  };
  std::uniform_int_distribution<uint32_t> cps(0xA0, 0x10FFFF), bytes(0, 255), len(0, 24);
  loom::test::TmpDir dir;
  Drawing d(120, 30, loom::report::kBackground);  // a failed cairo call would stay failed: checked each trial
  for (int trial = 0; trial < 200; ++trial) {
    std::string valid;
    for (uint32_t n = len(rng); n > 0; --n) {
      uint32_t cp = cps(rng);
      if (cp >= 0xD800 && cp < 0xE000) cp -= 0x1000;  // no surrogates
      valid += encode(cp);
    }
    ASSERT_EQ(printable(valid), valid);
    std::string junk;
    for (uint32_t n = len(rng); n > 0; --n) junk += char(bytes(rng));
    d.text(2, 15, junk, loom::report::kInk, 12);
    d.text(2, 15, valid, loom::report::kInk, 12);
    d.text(2, 15, d.fit(junk + valid, 50, 12, 8).text, loom::report::kInk, 8);
    ASSERT_NO_THROW(d.write_png(dir.str() + "/t.png")) << "trial " << trial;
  }
}

// fit keeps the text when it fits at some size, else cuts whole characters
// and ends with "…"; either way it is never wider than asked.
TEST(Drawing, FitShrinksThenCutsWholeCharacters) {
  Drawing d(10, 10, loom::report::kBackground);
  std::mt19937 rng(3);
  const std::vector<std::string> pieces = {"a", "W", "run", "-", "\xC3\xA9", "\xE2\x9C\x93", "\xF0\x9F\x98\x80", " "};
  std::uniform_int_distribution<size_t> piece(0, pieces.size() - 1), count(1, 40);
  std::uniform_real_distribution<double> width(5, 400);
  for (int trial = 0; trial < 200; ++trial) {
    std::string s;
    for (size_t n = count(rng); n > 0; --n) s += pieces[piece(rng)];
    const double max_w = width(rng);
    const auto f = d.fit(s, max_w, 14, 9);
    ASSERT_GE(f.size, 9);
    ASSERT_LE(f.size, 14);
    if (!f.text.empty()) ASSERT_LE(d.text_width(f.text, f.size), max_w) << s;
    if (f.text != s) {
      ASSERT_EQ(f.size, 9) << "cut only at the smallest size";
      if (f.text.empty()) continue;  // not even "…" fits
      const std::string ellipsis = "\xE2\x80\xA6";
      ASSERT_GE(f.text.size(), ellipsis.size());
      ASSERT_EQ(f.text.substr(f.text.size() - ellipsis.size()), ellipsis) << f.text;
      const std::string kept = f.text.substr(0, f.text.size() - ellipsis.size());
      ASSERT_EQ(s.compare(0, kept.size(), kept), 0) << "a prefix of the text";
      ASSERT_TRUE(kept.size() == s.size() || (static_cast<unsigned char>(s[kept.size()]) & 0xC0) != 0x80)
          << "cut inside a character: " << f.text;
      // One more character would not have fitted.
      ASSERT_GT(d.text_width(s.substr(0, kept.size() + 1) + ellipsis, 9), max_w - 1e-9);
    } else {
      // The largest size that fits: one pixel larger would not (or it is the largest).
      if (f.size < 14) ASSERT_GT(d.text_width(s, f.size + 1), max_w);
    }
  }
}

// Axes over every magnitude and sign: the ticks are 1, 2 or 5 times a power
// of ten, cover the data, number about five, and their labels are distinct
// and read back as the ticks.
TEST(Drawing, NiceAxesCoverTheDataWithReadableTicks) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> expo(-9, 9), unit(-1, 1), span(-6, 0);
  for (int trial = 0; trial < 2000; ++trial) {
    const double scale = std::pow(10.0, expo(rng));
    double lo = unit(rng) * scale, hi = lo + std::fabs(unit(rng)) * scale * std::pow(10.0, span(rng));
    if (trial % 10 == 0) hi = lo;  // flat
    const auto a = loom::report::nice_axis(lo, hi);
    SCOPED_TRACE(::testing::Message() << "lo=" << lo << " hi=" << hi);
    ASSERT_LE(a.lo, lo);
    ASSERT_GE(a.hi, hi);
    if (lo == hi) ASSERT_TRUE(a.lo < lo && lo < a.hi) << "a flat range gets room around it";
    const double mant = a.step / std::pow(10.0, std::floor(std::log10(a.step) + 1e-9));
    ASSERT_TRUE(std::fabs(mant - 1) < 1e-6 || std::fabs(mant - 2) < 1e-6 || std::fabs(mant - 5) < 1e-6) << a.step;
    ASSERT_GE(a.ticks.size(), 2u);
    ASSERT_LE(a.ticks.size(), 12u);
    ASSERT_NEAR(a.ticks.front(), a.lo, a.step * 1e-6);
    ASSERT_NEAR(a.ticks.back(), a.hi, a.step * 1e-6);
    std::set<std::string> labels;
    for (size_t i = 0; i < a.ticks.size(); ++i) {
      if (i > 0) ASSERT_NEAR(a.ticks[i] - a.ticks[i - 1], a.step, a.step * 1e-6);
      const std::string l = a.label(a.ticks[i]);
      ASSERT_LE(l.size(), 14u) << l;
      ASSERT_TRUE(labels.insert(l).second) << "two ticks labelled " << l;
      ASSERT_NEAR(std::strtod(l.c_str(), nullptr), a.ticks[i], a.step * 0.05) << l;
    }
  }
  // Steps are whole numbers: with a minimum step of 1, so are the ticks.
  for (auto [lo, hi] : {std::pair{1.0, 1.0}, {1.0, 3.0}, {0.0, 4.0}, {7.0, 9.0}, {1.0, 500.0}}) {
    const auto a = loom::report::nice_axis(lo, hi, 5, 1);
    EXPECT_GE(a.step, 1);
    for (double t : a.ticks) EXPECT_EQ(t, std::round(t)) << lo << ".." << hi;
    EXPECT_LE(a.lo, lo);
    EXPECT_GE(a.hi, hi);
  }
  // Nothing finite, and finite extremes, still give a usable axis.
  for (auto [lo, hi] : {std::pair{kNaN, kNaN}, {kInf, -kInf}, {-1e308, 1e308}, {0.0, 0.0}}) {
    const auto a = loom::report::nice_axis(lo, hi);
    EXPECT_TRUE(std::isfinite(a.lo) && std::isfinite(a.hi) && a.lo < a.hi) << lo << " " << hi;
    EXPECT_FALSE(a.ticks.empty());
  }
  const loom::report::Frame f{{10, 20, 101, 51}, loom::report::nice_axis(0, 10), loom::report::nice_axis(-1, 1)};
  EXPECT_DOUBLE_EQ(f.px(f.x.lo), 10);
  EXPECT_DOUBLE_EQ(f.px(f.x.hi), 110);
  EXPECT_DOUBLE_EQ(f.py(f.y.lo), 70);  // y grows upwards
  EXPECT_DOUBLE_EQ(f.py(f.y.hi), 20);
  EXPECT_LE(std::fabs(f.px(1e300)), 1e6) << "far values are clamped, so no int conversion overflows";
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

