"""Tensor and data parallelism on torch.distributed."""
