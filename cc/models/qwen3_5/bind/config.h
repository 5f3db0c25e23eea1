// The casters of this family's config and weights for its modules (bridge.h's V4_FIELDS_CASTER).
#pragma once

#include "cc/common/bridge.h"
#include "cc/models/qwen3_5/config.h"
#include "cc/models/qwen3_5/qwen3_5_layer_forward.h"

namespace nanobind::detail {
V4_FIELDS_CASTER(Qwen35Config, V4_QWEN35_CONFIG_FIELDS)
V4_FIELDS_CASTER(GatedDeltaNetWeights, V4_GATED_DELTANET_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(GatedAttentionWeights, V4_GATED_ATTENTION_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(Qwen35MoeWeights, V4_QWEN35_MOE_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(Qwen35LayerWeights, V4_QWEN35_LAYER_WEIGHTS_FIELDS)
}  // namespace nanobind::detail
