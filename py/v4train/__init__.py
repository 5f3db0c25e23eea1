"""v4train: fine-tuning GLM-5 and Qwen3.5 MoE models. Compute in C++ (v4_* ops), control in Python."""
