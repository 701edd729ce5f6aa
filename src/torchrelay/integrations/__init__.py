"""Bring your own trainer: a framework's own loop with torchrelay's contract, checkpoints, data order and stops."""
