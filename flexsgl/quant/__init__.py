"""Quantized weights: a checkpoint's quantization_config (scheme), FP8 arithmetic (fp8), the FP8
linear layer that keeps FP8 weights on GPUs with FP8 matrix products (fp8_linear), and what loading
does with a model's projections (apply)."""
