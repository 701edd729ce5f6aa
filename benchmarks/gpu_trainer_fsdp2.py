"""Hugging Face Trainer with FSDP2 through accelerate, bit-exact across stops, on GPUs with NCCL.

    PYTHONPATH=src python3 benchmarks/gpu_trainer_fsdp2.py --out /tmp/trainer-fsdp2

The script is tests/trainer_fsdp2.py (its docstring says what it runs and compares): the suite runs its CPU path
with gloo (tests/test_trainer_fsdp2.py), so the worker lives with the tests and this command stays the one
benchmarks/RESULTS.md records.
"""

from __future__ import annotations

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(
        str(Path(__file__).resolve().parents[1] / "tests" / "trainer_fsdp2.py"), run_name="__main__"
    )
