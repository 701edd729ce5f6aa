"""torchrelay: distributed PyTorch training runs that stop anywhere and continue bit for bit, with proof."""

__version__ = "0.1.0"
