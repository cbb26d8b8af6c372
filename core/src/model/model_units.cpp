// The parameter layout of a spec, as the blocks declare it (model.hpp).
#include "loom/model.hpp"

#include "model/model.hpp"

namespace loom {

const char* param_role_name(ParamRole r) {
  switch (r) {
    case ParamRole::matrix: return "matrix";
    case ParamRole::output_projection: return "output_projection";
    case ParamRole::norm_gain: return "norm_gain";
    case ParamRole::embedding: return "embedding";
  }
  return "?";
}

std::vector<UnitInfo> model_units(const ModelSpec& spec, const std::string& layers) {
  return Model(spec, layers).units();
}

}  // namespace loom
