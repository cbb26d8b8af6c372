#include "data/megatron/megatron_data.hpp"

LOOM_PLUGIN(data, loom::plugins::MegatronData, "megatron", "1.0.0",
            "Megatron-LM indexed datasets (.bin/.idx), GPTDataset sampling, weighted blends, exact resume")
