"""Export a checkpoint's model weights for serving (safetensors, the layout Hugging Face loads)."""

from torchrelay.export.parity import ParityError, ParityOptions
from torchrelay.export.weights import ExportOptions, ExportResult, export_weights, parse_rename, parse_size

__all__ = [
    "ExportOptions",
    "ExportResult",
    "ParityError",
    "ParityOptions",
    "export_weights",
    "parse_rename",
    "parse_size",
]
