#include "cc/common/rope.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace v4 {
namespace {

constexpr double kPi = 3.14159265358979323846;

double yarn_mscale(double scale, double mscale = 1.0) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// Inverse frequencies [dim / 2] (float32) and the factor cos/sin are multiplied by; transformers'
// _compute_default_rope_parameters and _compute_yarn_parameters.
std::pair<at::Tensor, double> inv_freq_and_scale(const Rope& rope, const at::Device& device) {
  const int64_t dim = rope.dim;
  const double base = rope.theta;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor pos_freqs = at::pow(base, at::arange(0, dim, 2, f32) / static_cast<double>(dim));
  if (rope.type == "default") return {(1.0 / pos_freqs).to(device), 1.0};
  const double factor = rope.factor;
  double attention_factor;
  if (rope.attention_factor) {
    attention_factor = *rope.attention_factor;
  } else if (rope.mscale != 0 && rope.mscale_all_dim != 0) {
    attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim);
  } else {
    attention_factor = yarn_mscale(factor);
  }
  const auto correction_dim = [&](double rotations) {
    return (dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * kPi))) / (2 * std::log(base));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const at::Tensor ramp = at::clamp((at::arange(dim / 2, f32) - low) / (high - low), 0, 1);
  const at::Tensor extrapolation = 1 - ramp;
  const at::Tensor inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation;
  return {inv_freq.to(device), attention_factor};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const Rope& rope, const at::Tensor& positions, at::ScalarType dtype) {
  const auto [inv_freq, scale] = inv_freq_and_scale(rope, positions.device());
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {(emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)};
}

double rope_softmax_scale_factor(const Rope& rope) {
  if (rope.type != "default" && rope.mscale_all_dim != 0) {
    const double m = yarn_mscale(rope.factor, rope.mscale_all_dim);
    return m * m;
  }
  return 1.0;
}

at::Tensor rope_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = cos.size(-1) / 2;
  const at::Tensor c = cos.slice(-1, 0, half).unsqueeze(1);
  const at::Tensor s = sin.slice(-1, 0, half).unsqueeze(1);
  const at::Tensor x1 = x.slice(-1, 0, c10::nullopt, 2), x2 = x.slice(-1, 1, c10::nullopt, 2);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = cos.size(-1);
  const at::Tensor rot = x.slice(-1, 0, d), rest = x.slice(-1, d);
  const at::Tensor r1 = rot.slice(-1, 0, d / 2), r2 = rot.slice(-1, d / 2);
  const at::Tensor rotated = rot * cos.unsqueeze(1) + at::cat({-r2, r1}, -1) * sin.unsqueeze(1);
  return at::cat({rotated, rest}, -1);
}

}  // namespace v4
