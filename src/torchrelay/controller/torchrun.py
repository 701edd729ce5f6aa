"""torchrun's output, with its failure report of a planned stop left out, and the ranks' own exit code.

torchrun reports any rank's non-zero exit as a failure: an `[ERROR] failed (exitcode: 3)` line, then a traceback of
its own ending in `ChildFailedError` and a box naming the script FAILED, and it exits 1. A clean stop (3 budget,
4 request, 5 signal, 6 memory) is no failure: `torchrelay launch` and `python -m torchrelay.controller.torchrun` pass the
output through a `TorchrunOutput`, which holds that report back and writes one line instead when every rank it
names ended with a planned stop; any other report (a crash, a refusal) is written as torchrun wrote it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from torchrelay.errors import EXIT_BUDGET, EXIT_MEMORY, EXIT_REQUEST, EXIT_SIGNAL

PLANNED = frozenset({EXIT_BUDGET, EXIT_REQUEST, EXIT_SIGNAL, EXIT_MEMORY})
_MEANING = {EXIT_BUDGET: "budget", EXIT_REQUEST: "request", EXIT_SIGNAL: "signal", EXIT_MEMORY: "memory"}
# torchrun's agent, per rank that ended non-zero: `E1207 05:43:15.486000 10219 torch/distributed/elastic/
# multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 0 (pid: 10289) of binary: ...`
_AGENT_FAILED = re.compile(r"elastic/multiprocessing/api\.py:\d+\]\s+failed \(exitcode: (-?\d+)\)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RULE = re.compile(r"^={20,}\s*$")
_HELD_MAX = 500  # lines: past this, what is held is not torchrun's report (which is about 40 lines)


class TorchrunOutput:
    """A line filter: `write(line)` for each line of torchrun's output, `close()` at its end."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.codes: list[int] = []  # the exit codes of the ranks in torchrun's last report, root cause first
        self._held: list[str] = []
        self._report = False  # the held traceback is torchrun's (it raised ChildFailedError)
        self._rules = 0

    def write(self, line: str) -> None:
        """Pass one line on (with its newline), or hold it while it may belong to a planned stop's report."""
        text = line.rstrip("\n")
        if not self._held:
            agent = _AGENT_FAILED.search(text)
            if agent and int(agent.group(1)) in PLANNED:
                return  # its traceback follows; what the ranks did is said once, when that ends
            if text.startswith("Traceback (most recent call last):"):
                self._held.append(line)
                return
            self._emit(line)
            return
        self._held.append(line)
        if not self._report:
            if "ChildFailedError" in text:
                self._report = True
            elif text and not text.startswith((" ", "\t")):
                self._flush()  # the exception line of some other traceback: not torchrun's report
            elif len(self._held) > _HELD_MAX:
                self._flush()
            return
        if _RULE.match(text):
            self._rules += 1
            if self._rules >= 2:  # the box's closing rule: the report is complete
                self._settle()
        elif len(self._held) > _HELD_MAX:
            self._flush()

    def close(self) -> None:
        """The output ended: anything held is written as it came."""
        if self._report and self._rules >= 1:
            self._settle()
        self._flush()

    def _settle(self) -> None:
        lines = [line.rstrip("\n") for line in self._held]
        failures = "\n".join(lines).split("Root Cause", 1)
        codes = [
            int(m.group(1)) for part in failures[::-1] for m in map(_EXITCODE.match, part.splitlines()) if m
        ]
        self.codes = codes
        if codes and all(code in PLANNED for code in codes):
            shown = sorted(set(codes))
            what = ", ".join(f"{code} ({_MEANING[code]})" for code in shown)
            self._held = []
            self._emit(
                f"torchrun: {len(codes)} rank(s) ended with a planned stop, exit {what}; "
                "torchrun's failure report is left out\n"
            )
        self._flush()

    def _flush(self) -> None:
        held, self._held = self._held, []
        self._report, self._rules = False, 0
        for line in held:
            self._emit(line)

    def _emit(self, line: str) -> None:
        try:
            self.out.write(line)
            self.out.flush()
        except (OSError, ValueError):
            pass  # our own output is gone (closed terminal); the caller keeps draining the child


def ranks_exit(returncode: int, codes: Sequence[int]) -> int:
    """The exit code the ranks meant: the root cause's from torchrun's report, else torchrun's own."""
    if returncode == 0 or not codes:
        return returncode
    return (
        codes[0] if codes[0] >= 0 else 128 - codes[0]
    )  # a rank killed by signal N: 128 + N, as a shell says


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m torchrelay.controller.torchrun ARGS`: `torchrun ARGS` whose planned stops look like one, with their code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # torchrun dies of SIGUSR1 (Slurm's warning signal reaches every process of the step): ignored, it waits for
    # its ranks, which install their own handler when the run opens (an ignored signal stays so across exec).
    # Ctrl-C and Slurm's SIGTERM reach torchrun too (same process group, same step); this process waits for it.
    for signum in (signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    # Only the error stream is read (torchrun's report and its agent's lines are there); the output is the ranks'.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args], stderr=subprocess.PIPE, text=True, bufsize=1
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    output = TorchrunOutput(sys.stderr)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            output.write(line)
        output.close()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    returncode = proc.wait()
    reader.join()
    return ranks_exit(returncode, output.codes)


if __name__ == "__main__":
    sys.exit(main())
