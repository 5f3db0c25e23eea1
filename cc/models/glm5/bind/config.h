// The caster of Glm5Config for this family's modules (bridge.h's V4_FIELDS_CASTER).
#pragma once

#include "cc/common/bridge.h"
#include "cc/models/glm5/config.h"

namespace nanobind::detail {
V4_FIELDS_CASTER(Glm5Config, V4_GLM5_CONFIG_FIELDS)
}  // namespace nanobind::detail
