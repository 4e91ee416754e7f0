"""Layers for multi-device and mixed-precision training."""

from keras_mgpu.layers.fp32_output_head import FP32OutputHead  # noqa: F401

__all__ = ["FP32OutputHead"]
