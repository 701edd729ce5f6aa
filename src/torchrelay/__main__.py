"""`python -m torchrelay VERB ...`."""

from torchrelay.cli import entry

entry()
