// The casters of this family's config and weights for its modules (bridge.h's V4_FIELDS_CASTER).
#pragma once

#include "cc/common/bridge.h"
#include "cc/models/glm5/config.h"
#include "cc/models/glm5/glm5_layer_forward.h"

namespace nanobind::detail {
V4_FIELDS_CASTER(Glm5Config, V4_GLM5_CONFIG_FIELDS)
V4_FIELDS_CASTER(IndexerWeights, V4_INDEXER_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(MlaWeights, V4_MLA_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(Glm5MoeWeights, V4_GLM5_MOE_WEIGHTS_FIELDS)
V4_FIELDS_CASTER(Glm5LayerWeights, V4_GLM5_LAYER_WEIGHTS_FIELDS)
}  // namespace nanobind::detail
