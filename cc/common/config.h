// What the model configs share (each family's config is cc/models/<family>/config.h), filled from
// the Python config objects (v4train.models) by the nanobind casters (bridge.h: V4_FIELDS_CASTER).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace v4 {

// Each config's fields are written once, as X(type, name, default): V4_DECLARE_FIELD declares
// them in the struct, and the caster (bridge.h) reads each by the same name from the Python
// object; py/tests/test_config_fields.py checks that every one of them is a field of the Python
// dataclass, of the matching kind.
#define V4_ROPE_FIELDS(X)                          \
  X(double, theta, 10000.0)                        \
  X(int64_t, dim, 0)                               \
  X(std::string, type, "default")                  \
  X(double, factor, 1.0)                           \
  X(int64_t, original_max_position_embeddings, 0) \
  X(double, beta_fast, 32.0)                       \
  X(double, beta_slow, 1.0)                        \
  X(double, mscale, 0.0)                           \
  X(double, mscale_all_dim, 0.0)                   \
  X(std::optional<double>, attention_factor, std::nullopt) \
  X(bool, truncate, true)

#define V4_DECLARE_FIELD(type, name, init) type name = init;

// v4train.models.config.Rope: rotary frequencies over `dim` dims, YaRN when type is "yarn".
struct Rope {
  V4_ROPE_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
