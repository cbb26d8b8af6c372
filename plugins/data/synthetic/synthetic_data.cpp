#include "data/synthetic/synthetic_data.hpp"

LOOM_PLUGIN(data, loom::plugins::SyntheticData, "synthetic", "1.0.0",
            "generated tokens (random or ramp), a pure function of seed and sample index")
