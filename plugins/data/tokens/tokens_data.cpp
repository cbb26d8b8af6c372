#include "data/tokens/tokens_data.hpp"

LOOM_PLUGIN(data, loom::plugins::TokensData, "tokens", "1.0.0",
            "token shards (loom prepare) cut into seq_len+1 windows, shuffled per epoch, exact resume")
