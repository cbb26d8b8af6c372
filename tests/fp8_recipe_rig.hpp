// A precision recipe made ready the way the core makes it (test_fp8_recipes,
// test_fp8_block): its linears registered, set up alone (a one-rank
// data-parallel group) for a device and gradient accumulation, and, on the
// CPU, given host memory for its workspace and saved activations.
#pragma once
#include <memory>
#include <vector>

#include "loom/comm.hpp"
#include "loom/precision.hpp"

namespace loom::test {

struct RecipeRig {
  std::unique_ptr<Precision> p;
  std::unique_ptr<Communicator> self = make_self_communicator();
  std::vector<float> ws, saved;
  std::vector<int> ids;
  RecipeRig(std::unique_ptr<Precision> recipe, const std::vector<LinearDesc>& linears, Device device = Device::cpu,
            int grad_accum = 1)
      : p(std::move(recipe)) {
    for (const auto& d : linears) ids.push_back(p->register_linear(d));
    PrecisionSetup s;
    s.data_parallel = self.get();
    s.device = device;
    s.grad_accum = grad_accum;
    p->setup(s);
    if (device != Device::cpu) return;  // device memory is the caller's to give
    size_t saved_bytes = 0;
    for (int id : ids) saved_bytes += p->saved_activation_bytes(id);
    ws.resize(p->workspace_bytes() / 4 + 1);
    saved.resize(saved_bytes / 4 + 1);
    p->set_workspace(ws.data(), p->workspace_bytes());
    p->set_saved_activations(saved.data(), saved_bytes);
  }
};

}  // namespace loom::test
