// Number formatting shared by the config messages (internal to core/src/config).
#pragma once
#include <charconv>
#include <cmath>
#include <string>

namespace loom::config_detail {

// Shortest text that reads back as the same double: plain digits for everyday
// magnitudes ("0.0003", "500000"), an unpadded exponent otherwise ("1e-8",
// "2.5e20"), and "nan"/"inf" as TOML spells them.
inline std::string format_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[400];  // fixed notation of a 1e15 magnitude needs few digits; the bound is for safety
  const double mag = std::fabs(v);
  const bool fixed = v == 0.0 || (mag >= 1e-4 && mag < 1e15);
  auto res = std::to_chars(buf, buf + sizeof(buf), v, fixed ? std::chars_format::fixed : std::chars_format::scientific);
  std::string s(buf, res.ptr);
  // to_chars writes "1e-08" / "1e+20"; drop the '+' and the exponent's leading zeros.
  size_t e = s.find('e');
  if (e != std::string::npos) {
    std::string mant = s.substr(0, e);
    std::string exp = s.substr(e + 1);
    bool neg = !exp.empty() && exp[0] == '-';
    if (!exp.empty() && (exp[0] == '-' || exp[0] == '+')) exp.erase(0, 1);
    exp.erase(0, std::min(exp.find_first_not_of('0'), exp.size() - 1));
    s = mant + "e" + (neg ? "-" : "") + exp;
  }
  return s;
}

}  // namespace loom::config_detail
