#include "cc/common/lora.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cc/common/backend.h"
#include "cc/common/experts.h"

namespace v4 {

bool has_adapter(const Linear& w, const char* op, const char* name) {
  TORCH_CHECK_VALUE(w.lora_A.has_value() == w.lora_B.has_value(), op, ": the adapter of ", name,
                    " has one of lora_A and lora_B but not the other");
  return w.lora_A.has_value();
}

at::Tensor adapter_input(const at::Tensor& x, const Lora& lora) {
  return lora.dropout > 0 ? at::dropout(x, lora.dropout, /*train=*/true) : x;
}

namespace {

constexpr int64_t kFp8Block = 128;  // the FP8 checkpoints' scale block: 128 x 128 weights

// Each block of weight times its scale, in fp32 (float64 for a float64 dtype), then in dtype.
at::Tensor dequantize(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype) {
  if (const auto kernel = Backend<Fp8Dequantize>::find(weight.device().type())) {
    at::Tensor result;
    if (kernel(weight, scale, dtype, result)) return result;
  }
  const int64_t out = weight.size(-2), in = weight.size(-1);
  const auto compute = dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (out % kFp8Block == 0 && in % kFp8Block == 0) {
    // Whole blocks: in place with each scale broadcast over its block, not expanded to the
    // weight's size (the GPU takes fp8.cu's one pass before this). The FP8 values are exact in
    // every floating dtype, and mul_ computes in `compute` and rounds once to dtype, as the
    // expression below does.
    std::vector<int64_t> blocks(weight.sizes().begin(), weight.sizes().end() - 2), scales = blocks;
    blocks.insert(blocks.end(), {out / kFp8Block, kFp8Block, in / kFp8Block, kFp8Block});
    scales.insert(scales.end(), {out / kFp8Block, 1, in / kFp8Block, 1});
    at::Tensor result = weight.to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
    result.view(blocks).mul_(scale.to(compute).reshape(scales));
    return result;
  }
  const at::Tensor s = scale.to(compute).repeat_interleave(kFp8Block, -2).slice(-2, 0, out)
                           .repeat_interleave(kFp8Block, -1).slice(-1, 0, in);
  return (weight.to(compute) * s).to(dtype);
}

// The scales fit the weight (one per block), and neither asks for a gradient (a frozen base).
void check_fp8(const Linear& w, const char* op, const char* name) {
  const at::Tensor &weight = w.weight, &scale = *w.weight_scale_inv;
  TORCH_CHECK_VALUE(weight.dim() >= 2 && scale.dim() == weight.dim(), op, ": ", name, ".weight_scale_inv has shape ",
                    scale.sizes(), " for a weight of shape ", weight.sizes());
  const int64_t out = weight.size(-2), in = weight.size(-1);
  bool fits = scale.size(-2) == (out + kFp8Block - 1) / kFp8Block && scale.size(-1) == (in + kFp8Block - 1) / kFp8Block;
  for (int64_t d = 0; d + 2 < weight.dim(); ++d) fits = fits && scale.size(d) == weight.size(d);
  TORCH_CHECK_VALUE(fits, op, ": ", name, ".weight_scale_inv has shape ", scale.sizes(), ", expected one scale per ",
                    kFp8Block, "x", kFp8Block, " block of its weight ", weight.sizes());
  TORCH_CHECK_VALUE(!weight.requires_grad() && !scale.requires_grad(), op, ": ", name, " is an FP8 weight that ",
                    "requires a gradient; an FP8 base is frozen (train LoRA adapters on it, or dequantise it on load)");
}

// The rows of x grouped as d says times each expert's FP8 weight: W_e^T, or W_e where
// `transposed`. By the device's Fp8GroupedProduct where it takes them, else dequantised.
at::Tensor fp8_grouped(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const Dispatch& d,
                       bool transposed, unsigned tensor_cores) {
  if (const auto kernel = Backend<Fp8GroupedProduct>::find(x.device().type())) {
    at::Tensor y;
    const bool e4m3 = (tensor_cores & kFp8Experts) || (!transposed && (tensor_cores & kFp8ExpertsForward));
    if (kernel(x, weight, scale, d.offsets, transposed, e4m3, y)) return y;
  }
  const at::Tensor w = dequantize(weight, scale, x.scalar_type());
  return grouped_linear(x, transposed ? w.transpose(1, 2) : w, d);
}

// dy W for a dense FP8 map: on FP8 tensor cores where tensor_cores asks for it, by the
// experts' kernel with W as the one expert (cuBLAS's FP8 GEMM takes only a row-major A times a
// column-major B, and dy W needs W's transpose in FP8; the kernel transposes tiles in shared
// memory), else W dequantised just in time.
at::Tensor fp8_dense_backward(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& scale,
                              unsigned tensor_cores) {
  const auto kernel = Backend<Fp8GroupedProduct>::find(dy.device().type());
  if (kernel && (tensor_cores & kFp8DenseBackward) && dy.numel() > 0) {
    const at::Tensor rows = dy.reshape({-1, dy.size(-1)});
    const at::Tensor offsets = at::full({1}, rows.size(0), dy.options().dtype(at::kInt));
    at::Tensor dx;
    if (kernel(rows, weight.unsqueeze(0), scale.unsqueeze(0), offsets, true, true, dx)) {
      std::vector<int64_t> sizes(dy.sizes().begin(), dy.sizes().end());
      sizes.back() = weight.size(1);
      return dx.view(sizes);
    }
  }
  return at::matmul(dy, dequantize(weight, scale, dy.scalar_type()));
}

// x times an FP8 weight: x W^T, or with a dispatch each row of x times its expert's weight
// [E, out, in], with the products fp8_tensor_cores() named when the forward ran (read once a
// product, on every device, so that a wrong word fails on the CPU too). The dense forward runs on
// FP8 tensor cores where it asks, the device has Fp8Linear and it takes the inputs; else the weight
// is dequantised just in time; the dense backward: fp8_dense_backward. The grouped product takes
// fp8_grouped both ways: an expert sees few rows (4,096 tokens x 8 of 256 experts: 128), so its
// dequantisation (3 bytes a weight) costs more than its product (256 flops a weight), where a
// dense map's product over 4,096 rows costs over ten times its dequantisation and cuBLAS on the
// dequantised weight stays. It keeps the FP8 weight and its scales, not the dense copy that
// autograd of the product would keep (more memory than the weights dequantised on load).
struct Fp8Product : public torch::autograd::Function<Fp8Product> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& scale, const Dispatch* grouped, int64_t tensor_cores) {
    ctx->save_for_backward({weight, scale});
    ctx->saved_data["tensor_cores"] = tensor_cores;
    const auto tc = unsigned(tensor_cores);
    if (grouped) {
      ctx->saved_data["counts"] = grouped->counts;
      ctx->saved_data["offsets"] = grouped->offsets;
      return fp8_grouped(x, weight, scale, *grouped, false, tc);
    }
    const auto kernel = Backend<Fp8Linear>::find(x.device().type());
    if (kernel && (tc & kFp8DenseForward)) {
      at::Tensor y;
      if (kernel(x, weight, scale, y)) return y;
    }
    return at::linear(x, dequantize(weight, scale, x.scalar_type()));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto tc = unsigned(ctx->saved_data["tensor_cores"].toInt());
    if (!ctx->saved_data.count("counts")) {
      return {fp8_dense_backward(grads[0], saved[0], saved[1], tc), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    Dispatch d;
    d.counts = ctx->saved_data["counts"].toTensor();
    d.offsets = ctx->saved_data["offsets"].toTensor();
    return {fp8_grouped(grads[0], saved[0], saved[1], d, true, tc), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

unsigned fp8_tensor_cores() {
  unsigned mask = 0;
  for (const std::string& word : env_words("V4TRAIN_FP8_TENSOR_CORES")) {
    if (word == "all" || word == "1") mask |= kFp8Experts | kFp8DenseBackward | kFp8DenseForward;
    else if (word == "experts") mask |= kFp8Experts;
    else if (word == "experts_forward") mask |= kFp8ExpertsForward;
    else if (word == "dense_backward") mask |= kFp8DenseBackward;
    else if (word == "dense_forward") mask |= kFp8DenseForward;
    else
      TORCH_CHECK_VALUE(word == "none" || word == "0", "V4TRAIN_FP8_TENSOR_CORES=",
                        std::getenv("V4TRAIN_FP8_TENSOR_CORES"), ": unknown product '", word,
                        "'; expected a comma list of experts, experts_forward, dense_backward and ",
                        "dense_forward, or all, 1, none, 0");
  }
  return mask;
}

at::Tensor dense_weight(const Linear& w, at::ScalarType dtype, const char* op, const char* name) {
  if (!w.weight_scale_inv) return w.weight;
  check_fp8(w, op, name);
  return dequantize(w.weight, *w.weight_scale_inv, dtype);
}

at::Tensor fp8_product(const at::Tensor& x, const Linear& w, const Dispatch* grouped, const char* op,
                       const char* name) {
  check_fp8(w, op, name);
  return Fp8Product::apply(x, w.weight, *w.weight_scale_inv, grouped, int64_t(fp8_tensor_cores()));
}

at::Tensor linear(const at::Tensor& x, const Linear& w, const Lora& lora, const char* op, const char* name) {
  const at::Tensor& weight = w.weight;
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(-1), op, ": ", name, ".weight has shape ",
                    weight.sizes(), ", expected [out, ", x.size(-1), "] for an input of shape ", x.sizes());
  at::Tensor y;
  if (w.weight_scale_inv) {
    y = fp8_product(x, w, nullptr, op, name);
  } else {
    TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), op, ": ", name, ".weight is ", weight.scalar_type(),
                      " but its input is ", x.scalar_type());
    y = at::linear(x, weight);
  }
  if (!has_adapter(w, op, name)) return y;
  const at::Tensor &a = *w.lora_A, &b = *w.lora_B;
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == weight.size(1) && b.size(0) == weight.size(0) &&
                        b.size(1) == a.size(0),
                    op, ": the adapter of ", name, " ", weight.sizes(), " has A ", a.sizes(), " and B ", b.sizes(),
                    ", expected [r, ", weight.size(1), "] and [", weight.size(0), ", r]");
  return y + at::linear(at::linear(adapter_input(x, lora), a), b) * lora.scaling;
}

}  // namespace v4
