"""Atomic, verifiable checkpoints: `checkpoint-<update>/` with an inventory written last."""
