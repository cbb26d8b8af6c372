// The table, CSV and file side of the comparison report; the chart is drawn
// in compare_chart.cpp.
#include "compare_report.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom::report {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string printf_double(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// v in the largest unit that keeps its mantissa under 1000 after rounding, with
// three significant digits ("1.23", "12.3", "123").
std::string scaled(double v, double base, const std::array<const char*, 5>& units, const char* sep) {
  if (std::isnan(v)) return "-";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  size_t k = 0;
  while (k + 1 < units.size() && std::fabs(v) >= 999.5) {
    v /= base;
    ++k;
  }
  const double a = std::fabs(v);
  const char* format = a < 9.995 ? "%.2f" : a < 99.95 ? "%.1f" : "%.0f";
  if (k == 0 && v == std::floor(v)) format = "%.0f";  // "512 B", "850", not "512.00 B"
  return printf_double(format, v) + sep + units[k];
}

std::string format_ms(double ms) {
  if (!std::isfinite(ms)) return std::isnan(ms) ? "-" : "inf";
  return printf_double(std::fabs(ms) < 10 ? "%.2f ms" : "%.1f ms", ms);
}

// Four decimals suit losses of a few units; very large or small ones go to
// scientific notation. NaN stays visible: a diverged run must not look fine.
std::string format_loss(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  const double a = std::fabs(v);
  return printf_double(a >= 1e4 || (a != 0 && a < 1e-3) ? "%.3e" : "%.4f", v);
}

// Differences span orders of magnitude (bitwise equal, 1e-7 rounding, 1e-1
// divergence), so scientific notation; an exact 0 is printed as such.
std::string format_diff(double v) {
  if (std::isnan(v)) return "-";
  if (v == 0) return "0";
  return std::isinf(v) ? "inf" : printf_double("%.2e", v);
}

// Table cells are one line each: error texts in notes may span several.
std::string one_line(std::string s) {
  std::replace_if(s.begin(), s.end(), [](char c) { return c == '\n' || c == '\r' || c == '\t'; }, ' ');
  return s;
}

struct Column {
  const char* header;
  bool left_aligned;  // text columns; numbers are right-aligned so their units line up
};

const std::vector<Column>& table_columns() {
  static const std::vector<Column> columns = {
      {"label", true},      {"ranks", false},          {"tokens/s/GPU", false}, {"TFLOP/s", false},
      {"MFU", false},       {"step", false},
      {"peak mem", false},  {"planned mem", false},    {"all_reduce", false}, {"reduce_scatter", false},
      {"all_gather", false}, {"broadcast", false},     {"all_to_all", false}, {"final loss", false},
      {"max |dloss|", false},
      {"max rel dloss", false}, {"note", true}};
  return columns;
}

std::vector<std::string> table_cells(const CompareRow& r) {
  std::vector<std::string> cells = {one_line(r.label), std::to_string(r.ranks),
                                    format_count(r.tokens_per_s_per_gpu) + " tok/s", printf_double("%.0f", r.model_tflops),
                                    printf_double("%.1f%%", 100.0 * r.mfu), format_ms(r.step_ms),
                                    format_bytes_binary(r.peak_mem_bytes), format_bytes_binary(r.planned_mem_bytes)};
  for (double b : r.bytes_per_step) cells.push_back(format_bytes_decimal(b));
  cells.push_back(r.failed() ? "-" : format_loss(r.final_loss));
  cells.push_back(format_diff(r.max_loss_diff));
  cells.push_back(format_diff(r.max_rel_loss_diff));
  cells.push_back(one_line(r.note));
  return cells;
}

// One table line: cells padded to their column's width, two spaces apart,
// without trailing blanks.
std::string table_line(const std::vector<std::string>& cells, const std::vector<size_t>& widths) {
  std::string line;
  for (size_t c = 0; c < cells.size(); ++c) {
    const std::string pad(widths[c] - cells[c].size(), ' ');
    if (c) line += "  ";
    line += table_columns()[c].left_aligned ? cells[c] + pad : pad + cells[c];
  }
  line.erase(line.find_last_not_of(' ') + 1);
  return line + "\n";
}

// RFC 4180 quoting: labels and error notes may contain commas, quotes or newlines.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

// The shortest text that reads back as the same double; to_chars spells
// non-finite values nan, inf and -inf, as strtod and most CSV readers accept.
std::string csv_number(double v) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

std::string summary_csv(const std::vector<CompareRow>& rows) {
  std::string out = "label,ranks,step_ms,tokens_per_s_per_gpu,peak_mem_bytes,planned_mem_bytes";
  for (const char* name : kCollectiveNames) out += cat(",", name, "_bytes_per_step");
  out += ",steps,final_loss,max_loss_diff,max_rel_loss_diff,note,model_tflops,mfu\n";
  for (const auto& r : rows) {
    out += cat(csv_field(r.label), ",", r.ranks, ",", csv_number(r.step_ms), ",", csv_number(r.tokens_per_s_per_gpu),
               ",", csv_number(r.peak_mem_bytes), ",", csv_number(r.planned_mem_bytes));
    for (double b : r.bytes_per_step) out += "," + csv_number(b);
    out += cat(",", r.losses.size(), ",", csv_number(r.final_loss), ",", csv_number(r.max_loss_diff), ",",
               csv_number(r.max_rel_loss_diff), ",", csv_field(r.note), ",", csv_number(r.model_tflops), ",",
               csv_number(r.mfu), "\n");
  }
  return out;
}

std::string losses_csv(const std::vector<CompareRow>& rows) {
  std::string out = "step";
  size_t steps = 0;
  for (const auto& r : rows) {
    out += "," + csv_field(r.label);
    steps = std::max(steps, r.losses.size());
  }
  out += "\n";
  for (size_t s = 0; s < steps; ++s) {
    out += std::to_string(s + 1);
    for (const auto& r : rows) out += "," + (s < r.losses.size() ? csv_number(r.losses[s]) : std::string());
    out += "\n";
  }
  return out;
}

std::string val_losses_csv(const std::vector<CompareRow>& rows) {
  std::string out = "step";
  std::vector<long long> steps;
  for (const auto& r : rows) {
    out += "," + csv_field(r.label);
    for (const auto& [st, v] : r.val_losses) steps.push_back(st);
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  out += "\n";
  for (long long st : steps) {
    out += std::to_string(st);
    for (const auto& r : rows) {
      auto it = std::find_if(r.val_losses.begin(), r.val_losses.end(), [&](const auto& p) { return p.first == st; });
      out += "," + (it != r.val_losses.end() ? csv_number(it->second) : std::string());
    }
    out += "\n";
  }
  return out;
}

// The whole file or an error naming it. close() flushes, so a full disk is
// caught here too rather than leaving a silently truncated report.
void write_file(const std::string& path, std::string_view bytes) {
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (f) f.close();
  if (!f) throw Error(cat("cannot write '", path, "': ", errno ? std::strerror(errno) : "I/O error"));
}

}  // namespace

std::string format_count(double v) { return scaled(v, 1000, {"", "K", "M", "G", "T"}, ""); }
std::string format_bytes_binary(double bytes) { return scaled(bytes, 1024, {"B", "KiB", "MiB", "GiB", "TiB"}, " "); }
std::string format_bytes_decimal(double bytes) { return scaled(bytes, 1000, {"B", "KB", "MB", "GB", "TB"}, " "); }

void compute_diffs(std::vector<CompareRow>& rows) {
  if (rows.empty()) return;
  const std::vector<double> ref = rows[0].losses;  // a copy: rows[0] is updated too
  for (auto& row : rows) {
    const size_t common = std::min(ref.size(), row.losses.size());
    double max_abs = 0, max_rel = 0;
    bool compared = false;
    for (size_t i = 0; i < common; ++i) {
      const double a = row.losses[i], b = ref[i];
      const bool fa = std::isfinite(a), fb = std::isfinite(b);
      if (!fa && !fb) continue;  // both diverged: nothing to tell apart
      compared = true;
      // Only one diverged: infinitely different, so the table cannot call it a match.
      const double d = fa && fb ? std::fabs(a - b) : kInf;
      max_abs = std::max(max_abs, d);
      max_rel = std::max(max_rel, d == 0 ? 0 : d / std::fabs(b));  // b == 0 gives inf, as it should
    }
    row.max_loss_diff = compared ? max_abs : kNaN;
    row.max_rel_loss_diff = compared ? max_rel : kNaN;
    // Validation: at the steps both evaluated.
    double max_val = 0;
    bool any = false;
    for (const auto& [st, v] : row.val_losses)
      for (const auto& [rs, rv] : rows[0].val_losses)
        if (rs == st) {
          any = true;
          const double d = std::isfinite(v) && std::isfinite(rv) ? std::fabs(v - rv) : kInf;
          max_val = std::max(max_val, d == 0 ? 0 : d / std::fabs(rv));
        }
    row.max_rel_val_diff = any ? max_val : kNaN;
  }
}

std::string format_table(const std::vector<CompareRow>& rows) {
  const auto& columns = table_columns();
  std::vector<std::string> header;
  for (const auto& c : columns) header.push_back(c.header);
  std::vector<std::vector<std::string>> body;
  for (const auto& r : rows) body.push_back(table_cells(r));

  std::vector<size_t> widths(columns.size(), 0);
  size_t total = 2 * (columns.size() - 1);  // the gaps between columns
  for (size_t c = 0; c < columns.size(); ++c) {
    widths[c] = header[c].size();
    for (const auto& cells : body) widths[c] = std::max(widths[c], cells[c].size());
    total += widths[c];
  }

  std::string out = table_line(header, widths) + std::string(total, '-') + "\n";
  for (const auto& cells : body) out += table_line(cells, widths);
  if (rows.empty()) return out + "(no runs)\n";
  out += cat("collective bytes are per rank and step; loss differences are against '", one_line(rows[0].label),
             "'\n");
  // Validation losses, where the runs evaluated: the last one and the largest
  // relative difference to the first row at any evaluation both made.
  for (const auto& r : rows) {
    if (r.val_losses.empty()) continue;
    out += cat("validation ", one_line(r.label), ": ", r.val_losses.size(), " evaluations, last (step ",
               r.val_losses.back().first, ") ", r.val_losses.back().second,
               ", max rel diff to '", one_line(rows[0].label), "' ", format_diff(r.max_rel_val_diff), "\n");
  }
  return out;
}

std::string losses_csv_path(const std::string& path) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + "_losses.csv")).string();
}

std::string val_losses_csv_path(const std::string& path) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + "_val_losses.csv")).string();
}

void write_csv(const std::string& path, const std::vector<CompareRow>& rows) {
  write_file(path, summary_csv(rows));
  write_file(losses_csv_path(path), losses_csv(rows));
  if (std::any_of(rows.begin(), rows.end(), [](const CompareRow& r) { return !r.val_losses.empty(); }))
    write_file(val_losses_csv_path(path), val_losses_csv(rows));
}

void write_png(const std::string& path, const std::vector<CompareRow>& rows, const std::string& title) {
  render_chart(rows, title).drawing.write_png(path);
}

std::vector<CompareRow> read_peer_rows(const std::string& path) {
  const std::string where = cat("--peer=", path);
  require_regular_file(path, "--peer file");  // a FIFO would block the read for ever
  std::ifstream in(path);
  if (!in) throw Error(cat(where, ": cannot read it (", std::strerror(errno), ")"));
  const char* kRow = "a PEER_JSON row of benchmarks/torch_fsdp.py (or hf_llama.py, hf_mixtral.py)";
  std::vector<CompareRow> rows;
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    const std::string at = cat(where, ":", line_no);
    std::string_view text(line);
    const size_t tag = text.find("PEER_JSON");
    if (tag != std::string_view::npos) text = text.substr(tag + 9);
    size_t b = text.find_first_not_of(" \t\r");
    if (tag == std::string_view::npos && (b == std::string_view::npos || text[b] != '{')) continue;  // log lines
    if (b == std::string_view::npos) b = text.size();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text.substr(b));
    } catch (const nlohmann::json::exception& e) {
      throw Error(cat(at, ": not a JSON object (", e.what(), "); expected ", kRow));
    }
    auto wrong = [&](const std::string& what) {
      return Error(cat(at, ": not ", kRow, ": ", what));
    };
    auto number = [&](const char* key, bool required) -> std::optional<double> {
      if (!j.contains(key) || j[key].is_null()) {
        if (required) throw wrong(cat("\"", key, "\" is missing"));
        return std::nullopt;
      }
      if (!j[key].is_number()) throw wrong(cat("\"", key, "\" is ", j[key].dump(), ", not a number"));
      return j[key].get<double>();
    };
    if (!j.is_object()) throw wrong(cat("it is ", j.dump(), ", not an object"));
    CompareRow r;
    if (j.contains("mode") && !j["mode"].is_string()) throw wrong(cat("\"mode\" is ", j["mode"].dump(), ", not a string"));
    r.label = cat("torch ", j.value("mode", std::string("peer")));
    if (j.contains("world")) {
      if (!j["world"].is_number_integer() || j["world"].get<long long>() < 1)
        throw wrong(cat("\"world\" is ", j["world"].dump(), ", not a number of ranks"));
      r.ranks = j["world"].get<int>();
    }
    if (j.contains("error")) {
      r.note = cat("peer failed: ", j["error"].dump());
      rows.push_back(r);
      continue;
    }
    r.step_ms = *number("median_step_ms", true);
    if (!(r.step_ms > 0) || !std::isfinite(r.step_ms))
      throw wrong(cat("\"median_step_ms\" is ", j["median_step_ms"].dump(), ", not a positive time"));
    if (auto t = number("tokens_per_s_per_gpu", false)) r.tokens_per_s_per_gpu = *t;
    else if (auto w = number("tokens_per_s", false)) r.tokens_per_s_per_gpu = *w / r.ranks;
    else throw wrong("\"tokens_per_s_per_gpu\" (or \"tokens_per_s\") is missing");
    if (auto m = number("peak_reserved_bytes", false)) r.peak_mem_bytes = *m;
    if (j.contains("losses") && !j["losses"].is_null()) {
      if (!j["losses"].is_array()) throw wrong(cat("\"losses\" is ", j["losses"].dump(), ", not an array"));
      for (const auto& x : j["losses"]) {
        if (!x.is_number() && !x.is_null()) throw wrong(cat("\"losses\" holds ", x.dump(), ", not a number"));
        r.losses.push_back(x.is_number() ? x.get<double>() : kNaN);
      }
    }
    const std::optional<double> final_loss = number("final_loss", false);
    r.final_loss = final_loss ? *final_loss : r.losses.empty() ? 0.0 : r.losses.back();
    r.note = "peer (own initialisation: losses not comparable step by step)";
    rows.push_back(r);
  }
  if (rows.empty())
    throw Error(cat(where, ": holds no peer rows: expected ", kRow, ", one JSON object a line (give the file its output "
                    "was saved to)"));
  return rows;
}

}  // namespace loom::report
