"""The configuration layer: the typed run configuration, the tunables of the checkpoint core, and every
TORCHRELAY_* environment variable."""
