// The gradient half of an HF golden comparison, shared by the golden suites
// (test_golden: Llama and Mixtral; test_docmask: packed documents): every
// "grad.<name>" tensor of the reference file against the session's gradient
// of parameter <name>, each within tol(name) in relative L2.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "hf/safetensors.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace loom::test {

struct GradComparison {
  double worst = 0;        // the largest relative error
  std::string worst_name;  // its parameter
  int checked = 0;         // gradients compared
};

template <typename Tolerance>
GradComparison compare_grads(SessionProbe p, const hf::SafeTensorsFile& ref, Tolerance tol) {
  GradComparison r;
  for (const std::string& name : ref.names()) {
    if (name.rfind("grad.", 0) != 0) continue;
    const std::string param = name.substr(5);
    const double e = rel_l2(p.read_param(param, true), ref.read_f32(name));
    EXPECT_LT(e, tol(param)) << param;
    if (e > r.worst) r.worst = e, r.worst_name = param;
    ++r.checked;
  }
  return r;
}

}  // namespace loom::test
