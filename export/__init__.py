"""ONNX export for edge agents: write a model with a dynamic batch axis, then prove parity."""

from .onnx_export import export_onnx
from .parity import ParityError, check_parity

__all__ = ["ParityError", "check_parity", "export_onnx"]
