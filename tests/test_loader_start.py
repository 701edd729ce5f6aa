"""How a rank's loader workers start (data/loader.py): forked beside gloo's native threads, as torch's DataLoader
does, and from a forkserver while another thread runs Python; tqdm's monitor (Trainer's progress bar) asleep
across the fork, another DataLoader's queue feeder let be. What a worker itself reports decides: its parent (the rank when forked, the server otherwise) and
whether tqdm's lock was held when it was forked."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import PYTHON, clean_env

CHILD = """
import json, os, sys, threading
import torch
import torch.distributed as dist
from tqdm import tqdm
from torchrelay.data import loader as relay_loader
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder


class Parent(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        # a forked worker's copy of tqdm's lock is still held by the thread that forked it (the same ident)
        held = tqdm.get_lock().locks[-1]._is_owned() if hasattr(tqdm, "_lock") else False
        return torch.tensor([os.getppid(), int(held)])


def start():
    loader = RelayLoader(Parent(), None, 2)
    context, _ = loader.context()
    batches = RankBatches(GlobalOrder(num_samples=16, seed=1, global_batch=4), 0, 4, 0, 1, 4, 1)
    rows = [b for _, b in loader.start(batches, seed=1, context=context)]
    parents = sorted({int(r[0]) for b in rows for r in b})
    held = sorted({bool(r[1]) for b in rows for r in b})
    line = loader.describe(context) if hasattr(loader, "describe") else None
    return {"context": context, "line": line, "parents": parents, "held": held}


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(1))
    out = {"pid": os.getpid(), "os_threads": len(os.listdir("/proc/self/task"))}
    out["native"] = start()
    bar = tqdm(total=4, disable=True)  # Trainer's progress bar: tqdm's monitor thread starts with it
    # a DataLoader of the script's own, its workers kept: its index queue's feeder thread stays
    own = iter(torch.utils.data.DataLoader(list(range(8)), num_workers=1, persistent_workers=True))
    next(own)
    out["monitor"] = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    out["tqdm"] = start()
    done = threading.Event()
    writer = threading.Thread(target=done.wait, name="writer")  # a reporter's thread, a persist in flight
    writer.start()
    out["others"] = getattr(relay_loader, "other_python_threads", list)()
    out["python"] = start()
    done.set()
    writer.join()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
"""


def test_workers_fork_beside_native_threads_and_not_beside_a_python_thread(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run(
        [PYTHON, str(script), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src")),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    out = json.loads(lines[-1].removeprefix("RESULT "))
    pid = out["pid"]
    assert out["os_threads"] > 1  # gloo's TCP and run loops, two groups' worth
    # gloo's threads alone: forked, both workers children of this process
    assert out["native"] == {
        "context": "fork",
        "line": "LOADER_WORKERS 2 fork",
        "parents": [pid],
        "held": [False],
    }
    # tqdm's monitor and a queue's feeder: still forked, tqdm's lock held across the fork (the monitor asleep)
    assert out["monitor"] == ["QueueFeederThread", "tqdm_monitor"]
    assert out["tqdm"]["context"] == "fork" and out["tqdm"]["parents"] == [pid]
    assert out["tqdm"]["held"] == [True]
    # another thread running Python: a forkserver started them, the line says why
    assert out["others"] == ["writer"]
    python = out["python"]
    assert python["context"] == "forkserver" and len(python["parents"]) == 1 and python["parents"] != [pid]
    assert python["line"] == "LOADER_WORKERS 2 forkserver (other Python threads: writer)"
    assert "DeprecationWarning" not in proc.stderr, proc.stderr


def test_the_line_names_the_threads_the_choice_saw_and_a_thread_leaving_is_none() -> None:
    """The rank's LOADER_WORKERS line names the threads `context` saw when it chose a forkserver, not those of a
    later look (a loader's own queue feeders, leaving once its queues closed, were named: the suite saw
    `other Python threads: QueueFeederThread, writer`); a thread whose target has returned runs no Python of its
    own any more."""
    import threading

    from torchrelay.data import loader as relay_loader

    loader = relay_loader.RelayLoader(list(range(4)), None, 2)
    loader.context(others=["writer"])
    assert loader.describe("forkserver") == "LOADER_WORKERS 2 forkserver (other Python threads: writer)"
    assert loader.describe("fork") == "LOADER_WORKERS 2 fork"
    done = threading.Event()
    t = threading.Thread(target=done.wait, name="reporter")
    assert not relay_loader._target_returned(t)
    t.start()
    assert not relay_loader._target_returned(t) and "reporter" in relay_loader.other_python_threads()
    done.set()
    t.join()
    assert relay_loader._target_returned(t)


NO_LOADER_LOCK = """
import ctypes, os, sys
from torchrelay.data import loader

pid = os.fork()
if pid == 0:
    # a worker forked while another thread held the dynamic loader's lock would wait on it for good in dlopen or
    # dlsym: here both fail, and the worker must still ask to die with its parent
    def refused(*args, **kwargs):
        raise AssertionError("the worker looked up a symbol")

    ctypes.CDLL = refused
    ctypes.PyDLL = refused
    loader.die_with_parent()
    got = ctypes.c_int(-1)
    loader._PRCTL(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    os._exit(0 if got.value == 9 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_worker_asks_to_die_with_its_parent_without_the_dynamic_loader() -> None:
    done = subprocess.run([PYTHON, "-c", NO_LOADER_LOCK], capture_output=True, text=True, env=clean_env())
    assert done.returncode == 0, done.stderr
