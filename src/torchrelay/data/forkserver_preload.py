"""Imported only by the loader's forkserver (its preload list): the server dies with the rank that started it.

Its workers die with it in turn (see `_worker_init`). Without this, a rank killed outright would leave the server
and its workers behind for good: each worker holds the server's liveness pipe open, and DataLoader's watchdog
looks at the worker's parent, which is the server.
"""

from torchrelay.data.loader import die_with_parent

die_with_parent()
