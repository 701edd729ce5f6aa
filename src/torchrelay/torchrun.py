"""`python -m torchrelay.torchrun ARGS`: torchrun whose planned stops look like one (controller/torchrun.py)."""

import sys

from torchrelay.controller.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
