"""Two "nodes" on this one machine, real enough to catch what assumes one host.

Each node is a network namespace of its own (joined to the other by a veth pair, so the rendezvous, the gloo
traffic and the stop agreement cross a network link), a UTS namespace with its own hostname, and a mount namespace
with its own /etc/hosts (the nodes' names resolve to their addresses, as DNS does on a cluster) and a node-local
TMPDIR (a tmpfs the other node cannot see). The run directory is the one thing both see, as on a shared file
system. Needs root; without network namespaces (a container without CAP_NET_ADMIN) the nodes keep their own
hostnames, /etc/hosts and TMPDIR and talk over the loopback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from helpers import PYTHON, REPO, clean_env

NODE_SH = REPO / "tests" / "fixtures" / "node.sh"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Nodes:
    """`slots` nodes; a launch names the hostname each slot has (another launch may give them other names)."""

    def __init__(self, base: Path, slots: int = 2) -> None:
        self.base = base
        self.slots = slots
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"trn{tag}{chr(97 + i)}" for i in range(slots)]
        self.addr = [f"10.213.0.{i + 1}" for i in range(slots)]
        self.netns = False
        self.why_not = ""

    def available(self) -> str | None:
        """None when nodes can be made here, else why not."""
        if os.name != "posix" or os.geteuid() != 0:
            return "separate hostnames and mounts need root"
        for tool in ("unshare", "hostname", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        probe = subprocess.run(
            ["unshare", "--uts", "--mount", "--", "true"], capture_output=True, text=True, timeout=30
        )
        return None if probe.returncode == 0 else f"unshare --uts --mount failed: {probe.stderr.strip()}"

    def up(self) -> Nodes:
        """Network namespaces joined by one veth pair (2 slots), when this machine allows them."""
        self.base.mkdir(parents=True, exist_ok=True)
        if self.slots != 2 or shutil.which("ip") is None:
            self.why_not = "no `ip` command" if self.slots == 2 else "a veth pair joins two nodes only"
            return self
        steps = [
            *(("netns", "add", ns) for ns in self.ns),
            ("link", "add", f"{self.ns[0]}v", "type", "veth", "peer", "name", f"{self.ns[1]}v"),
        ]
        for i, ns in enumerate(self.ns):
            steps += [
                ("link", "set", f"{ns}v", "netns", ns),
                ("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", f"{ns}v"),
                ("-n", ns, "link", "set", f"{ns}v", "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                self.why_not = f"ip {' '.join(step)}: {out.stderr.strip()}"
                self.down()
                return self
        self.netns = True
        return self

    def down(self) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth pair, and so the pair
            _ip("netns", "del", ns)
        self.netns = False

    def address(self, slot: int) -> str:
        return self.addr[slot] if self.netns else "127.0.0.1"

    def command(
        self, slot: int, names: list[str], argv: list[str], binds: Sequence[tuple[Path, Path]] = ()
    ) -> list[str]:
        """argv run on node `slot` called names[slot]; every name in `names` resolves to its node; the node sees
        each (source, target) of `binds` at target."""
        hosts = self.base / f"hosts-{'-'.join(names)}"
        lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {n}" for i, n in enumerate(names)]
        hosts.write_text("\n".join(lines) + "\n")
        tmp = self.base / f"tmp-{names[slot]}"
        node = ["unshare", "--uts", "--mount", "--propagation", "private", "--"]
        node += ["bash", str(NODE_SH), names[slot], str(hosts), str(tmp)]
        for source, target in binds:
            node += ["--bind", str(source), str(target)]
        node += ["--", *argv]
        return ["ip", "netns", "exec", self.ns[slot], *node] if self.netns else node


def torchrun_2node(
    nodes: Nodes,
    names: list[str],
    code: Path,
    run_dir: Path,
    *,
    port: int,
    config: Path | None = None,
    sets: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    logs: Path,
    binds: dict[int, list[tuple[Path, Path]]] | None = None,
    args: list[str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """One torchrun agent per node (`--nnodes 2`, one rank each, c10d rendezvous on the first node's address);
    returns the agents, each in a session of its own, its output in logs/<name>.log. `binds`: per slot, files
    that node sees in place of the shared ones; `args`: more of the script's arguments (`--kill-at ...`)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for slot in range(2):
        argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={nodes.address(0)}:{port}",
                f"--rdzv_id=relay-{port}", "--monitor_interval=0.5",
                str(code / "train_lm.py"), "--run-dir", str(run_dir)]  # fmt: skip
        if config is not None:
            argv += ["--config", str(config)]
        for k, v in (sets or {}).items():
            argv += ["--set", f"{k}={v}"]
        argv += args or []
        out: IO[bytes] = open(logs / f"{names[slot]}.log", "ab")  # noqa: SIM115 - the child holds it
        with out:
            procs.append(
                subprocess.Popen(
                    nodes.command(slot, names, argv, (binds or {}).get(slot, [])),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=clean_env(**(env or {})),
                    cwd=code,
                    start_new_session=True,
                )
            )
    return procs
