// The caster of Qwen35Config for this family's modules (bridge.h's V4_FIELDS_CASTER).
#pragma once

#include "cc/common/bridge.h"
#include "cc/models/qwen3_5/config.h"

namespace nanobind::detail {
V4_FIELDS_CASTER(Qwen35Config, V4_QWEN35_CONFIG_FIELDS)
}  // namespace nanobind::detail
