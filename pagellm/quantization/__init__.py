"""Quantized weights: the checkpoint formats (AWQ, GPTQ, FP8), their layer methods, and `pagellm quantize`."""
