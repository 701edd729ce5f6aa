"""Loaded by Python at start-up in processes the audit launches (it puts this folder on PYTHONPATH).

Nothing is imported now: the probe installs itself right after the script imports torchrelay.run, so a
script that sets environment variables before importing torch still does so first.
"""

import importlib.util
import os
import sys


class _InstallProbeAfterRun:
    """A one-shot import hook: once torchrelay.run has loaded, wrap DataLoader iteration (see probe.py)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchrelay.run":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                from torchrelay.audit.probe import install

                install()
            except Exception as exc:  # noqa: BLE001 - a broken probe must not stop the user's script
                print(f"[torchrelay audit] probe not installed: {exc}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TORCHRELAY_AUDIT_PROBE"):
    sys.meta_path.insert(0, _InstallProbeAfterRun())

# This file shadows any other sitecustomize on the path (a venv's, a cluster's): run that one too.
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(os.path.abspath(_entry or "."), "sitecustomize.py")
    if os.path.dirname(_candidate) != _here and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_torchrelay_next_sitecustomize", _candidate)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
