import torch


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension.

    y = x / sqrt(mean(x**2, -1) + eps) * s,  s = weight (plain) or 1 + weight (zero_centered)

    x: [..., H] (float32, bfloat16 or float16), weight: [H]. Everything is computed in float32
    (float64 for float64 input: the parity suite's exact answer) and the result is cast to x's
    dtype once at the end.

    Matches transformers' Qwen3_5RMSNorm / Qwen3NextRMSNorm (zero_centered=True: weight
    initialised to 0, `output * (1.0 + self.weight.float())` in fp32). For the plain form,
    DeepseekV3RMSNorm (GLM-5) multiplies by the weight after casting the normalised x back to
    the input dtype; here the product is taken in fp32 as well (Liger-Kernel's "gemma" casting
    mode), which is identical in fp32 and differs by at most one rounding in bf16.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    scale = weight.to(compute)
    if zero_centered:
        scale = 1.0 + scale
    return (y * scale).to(x.dtype)
