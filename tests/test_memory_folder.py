"""The memory tier's folder on a node shared by several users and jobs (checkpoint/tiers.py, util/private_dir.py):
/dev/shm is every user's (1777), so each user's tier lives in a folder of its own (/dev/shm/torchrelay-<uid>), made
0700, and every folder torchrelay makes below the shared base is checked before it is used, read or written: a real
folder (no link), this user's, writable by no one else. A folder that fails is never used: one line naming it, the
durable tier then. Real folders and real users: the second user is a forked child that dropped to uid 65534."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from torchrelay.checkpoint.replica import keep_replica, replica_dir
from torchrelay.checkpoint.retention import LatestN
from torchrelay.checkpoint.tiers import Binding, choose_memory, memory_root, memory_storage
from torchrelay.errors import UnsafeInput
from torchrelay.paths.rundir import RunDir

NOBODY = 65534  # another user of the node
OTHER = 65533  # a third one
LINEAGE = "lin-shared-node"
SHM = Path("/dev/shm")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test acts as other users (setuid)")


def as_user(uid: int, fn: Callable[[], Any]) -> dict[str, Any]:
    """fn() in a forked child that dropped to `uid` (group too, no supplementary groups): {"ok": its result} or
    {"error": "Type: message"}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out: dict[str, Any] = {"ok": fn()}
            except BaseException as exc:  # noqa: BLE001 - what the child met is the parent's to judge
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"error": "the child said nothing"}')


def _run() -> RunDir:
    return RunDir(Path("/tmp/torchrelay-test-shared-node/run"))  # named only: memory_root hashes its path


def _chain(root: Path, below: Path) -> list[tuple[str, int, int]]:
    """(path, owner, mode) of each folder from below `below` down to `root` (lstat: links not followed)."""
    out = []
    here = below
    for name in root.relative_to(below).parts:
        here = here / name
        st = os.lstat(here)
        out.append(
            (
                str(here),
                st.st_uid,
                stat.S_IMODE(st.st_mode) | (stat.S_IFLNK if stat.S_ISLNK(st.st_mode) else 0),
            )
        )
    return out


@pytest.fixture
def nobody_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The default base of uid 65534's tier, removed before and after (whatever a test planted there)."""
    monkeypatch.delenv("TORCHRELAY_MEMORY_ROOT", raising=False)
    base = SHM / f"torchrelay-{NOBODY}"
    for _ in range(2):
        if base.is_symlink() or base.is_file():
            base.unlink()
        shutil.rmtree(base, ignore_errors=True)
        if _ == 0:
            yield base


# ------------------------------------------------------------------------------------- two users, one node
@needs_root
def test_a_second_user_on_the_node_gets_a_memory_folder_of_its_own(nobody_base: Path) -> None:
    """The first user's run made the tier's folder (here: root's, 0755, /dev/shm/torchrelay as before); a second
    user's tier is a folder of its own, each folder 0700 and its; a third user reads nothing in it."""
    (SHM / "torchrelay").mkdir(
        mode=0o755, exist_ok=True
    )  # what the first user's run left (as before the fix)

    def open_tier() -> str:
        root = memory_storage(LINEAGE, _run()).root
        (root / "checkpoint-1").mkdir()
        (root / "checkpoint-1" / "model.distcp").write_bytes(b"weights")  # as a writer does: the umask's mode
        os.chmod(root / "checkpoint-1" / "model.distcp", 0o644)
        return str(root)

    got = as_user(NOBODY, open_tier)
    assert "ok" in got, (
        got
    )  # before: PermissionError: [Errno 13] Permission denied: '/dev/shm/torchrelay/lin...'
    root = Path(got["ok"])
    assert root.is_relative_to(nobody_base), root
    assert [(o, m) for _, o, m in _chain(root, SHM)] == [(NOBODY, 0o700)] * 3, _chain(root, SHM)
    read = as_user(OTHER, lambda: (root / "checkpoint-1" / "model.distcp").read_bytes())
    assert read.get("error", "").startswith("PermissionError"), read


@needs_root
@pytest.mark.parametrize("planted", ["link", "owner", "mode"])
def test_a_default_folder_planted_by_another_user_is_refused_in_one_line(
    nobody_base: Path, tmp_path: Path, planted: str
) -> None:
    """Another user made /dev/shm/torchrelay-<uid> first: a link to a folder of its own, a folder of its own, or
    a folder this user owns but everyone may write: the tier refuses it in one line naming it, writes nothing."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o777)
    os.chown(target, NOBODY, NOBODY)  # a folder the user could write into: a link to it must not be used
    if planted == "link":
        nobody_base.symlink_to(target)
    else:
        nobody_base.mkdir(mode=0o755 if planted == "owner" else 0o777)
        os.chmod(nobody_base, 0o755 if planted == "owner" else 0o777)
        if planted == "mode":
            os.chown(nobody_base, NOBODY, NOBODY)
    got = as_user(NOBODY, lambda: str(memory_storage(LINEAGE, _run()).root))
    error = got.get("error", "")
    assert error.startswith("UnsafeInput: "), got
    assert "\n" not in error and str(nobody_base) in error, error
    why = {"link": "is a symbolic link", "owner": "belongs to uid 0", "mode": "is writable by others"}[
        planted
    ]
    assert why in error and "TORCHRELAY_MEMORY_ROOT" in error, error
    assert list(target.iterdir()) == []  # nothing written through the link


# -------------------------------------------------------------------------------- an explicit memory root
@pytest.fixture
def chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TORCHRELAY_MEMORY_ROOT: a folder the user chose (trusted as it is; what torchrelay makes under it is not)."""
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(base))
    return base


def test_each_folder_the_tier_makes_is_the_users_alone(chosen: Path) -> None:
    root = memory_storage(LINEAGE, _run()).root
    assert root.parent.parent == chosen
    # before: the lineage's folder was made with the umask's mode (0755): every user could list it
    assert [(o, m) for _, o, m in _chain(root, chosen)] == [(os.geteuid(), 0o700)] * 2, _chain(root, chosen)
    os.chmod(root.parent, 0o750)  # its own folder, readable by the group: tightened, nothing refused
    assert memory_storage(LINEAGE, _run()).root == root
    assert stat.S_IMODE(os.lstat(root.parent).st_mode) == 0o700


@needs_root
@pytest.mark.parametrize("planted", ["link", "owner", "group-writable"])
def test_a_planted_lineage_folder_under_a_chosen_root_is_refused(
    chosen: Path, tmp_path: Path, planted: str
) -> None:
    lineage = chosen / LINEAGE
    target = tmp_path / "elsewhere"
    target.mkdir()
    if planted == "link":
        lineage.symlink_to(target)
    else:
        lineage.mkdir(mode=0o700)
        if planted == "owner":
            os.chown(lineage, NOBODY, NOBODY)
        else:
            os.chmod(lineage, 0o770)
    with pytest.raises(UnsafeInput) as err:
        memory_storage(LINEAGE, _run())
    line = err.value.message
    assert "\n" not in line and line.startswith(f"{lineage} on "), line
    assert {"link": "is a symbolic link", "owner": f"belongs to uid {NOBODY}",
            "group-writable": "is writable by its group"}[planted] in line, line  # fmt: skip
    assert list(target.iterdir()) == []


def test_a_chosen_root_everyone_may_rename_in_is_refused(chosen: Path) -> None:
    os.chmod(chosen, 0o777)  # world-writable without the sticky bit: another user can swap a folder in it
    with pytest.raises(UnsafeInput, match="writable by every user without the sticky bit"):
        memory_storage(LINEAGE, _run())
    os.chmod(chosen, 0o1777)  # as /dev/shm and /tmp: each user's entries are its own
    assert memory_storage(LINEAGE, _run()).root.is_dir()


# ---------------------------------------------------------------------------- readers: open and replicas
def test_a_resume_reads_and_deletes_nothing_in_a_planted_folder(chosen: Path, tmp_path: Path) -> None:
    """choose_memory at open deletes the checkpoints past the resumed update: through a planted link that would be
    another folder's (here one holding checkpoint-20). It refuses the folder in one line and touches nothing."""
    target = tmp_path / "victim"
    (target / "checkpoint-20").mkdir(parents=True)
    (chosen / LINEAGE).symlink_to(target)
    root = memory_root(LINEAGE, _run())
    target.joinpath(root.name).symlink_to(target)
    binding = Binding(LINEAGE, str(_run().path), "ab" * 32, 2, 1, 1)
    choice = choose_memory(root, binding, durable_update=8, segments={"s"})
    assert choice.checkpoint is None and choice.update == 8
    assert len(choice.refused) == 1 and "\n" not in choice.refused[0], choice.refused
    assert choice.refused[0].startswith(f"memory tier refused: {chosen / LINEAGE} on "), choice.refused
    assert "is a symbolic link" in choice.refused[0]
    assert (target / "checkpoint-20").is_dir()  # before: deleted as a future past update 8


@needs_root
@pytest.mark.parametrize("planted", ["owner", "world-writable"])
def test_a_replica_is_not_written_into_a_folder_not_the_users_alone(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    from test_replica_units import _pack, _part

    root = tmp_path / "memory"
    root.mkdir(mode=0o700)
    folder = replica_dir(root, 0)
    folder.mkdir(mode=0o700)
    if planted == "owner":
        os.chown(folder, NOBODY, NOBODY)
    else:
        os.chmod(folder, 0o777)
    with caplog.at_level("WARNING", logger="torchrelay"):
        kept = keep_replica(root, 7, _pack(_part(tmp_path)), source=0, node=1, retention=LatestN(1))
    assert kept is None and list(folder.iterdir()) == []  # before: the replica was written into it
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and str(folder) in lines[0], lines


# -------------------------------------------------------------------------------- every rank decides alike
def test_one_ranks_unusable_folder_turns_the_tier_off_on_every_rank() -> None:
    from torchrelay.checkpoint.tiers import tier_verdict

    gib = 1 << 30
    fine = (1 * gib, 100 * gib, 100 * gib, None)
    bad = "/dev/shm/torchrelay-1000 on node-b belongs to uid 0, not this user's (uid 1000): ..."
    assert tier_verdict([fine, fine, fine, fine], 2, 2) == (2, None)
    keep, line = tier_verdict([fine, fine, fine, (1 * gib, 100 * gib, 100 * gib, bad)], 2, 2)
    assert keep == 0 and line == f"memory tier off for this segment: {bad}; the durable tier saves as before"
    keep, line = tier_verdict([(3 * gib, gib, gib, None)] * 2, 2, 1)  # the capacity check as before
    assert keep == 0 and line is not None and line.startswith("memory tier off for this segment: 2 slots")


def test_a_node_whose_folder_others_may_write_in_offers_no_part_at_a_multinode_open(
    chosen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The survey a node's first rank makes at a multi-node open reads nothing in a folder not the user's alone
    (a part planted there would be offered to the choice), in one line; the next tier is then used."""
    from test_replica_units import _part
    from torchrelay.checkpoint.replica_resume import survey

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    run = tmp_path / "run"
    run.mkdir()
    (run / "lineage.json").write_text(json.dumps({"lineage": LINEAGE, "parent_lineage": None}))
    root = memory_root(LINEAGE, RunDir(run))
    root.mkdir(parents=True, mode=0o700)
    _part(tmp_path).rename(root / "checkpoint-7")
    assert len((survey(RunDir(run), 0, 2) or {})["parts"]) == 1  # the user's own folder: offered
    os.chmod(root.parent, 0o777)
    with caplog.at_level("WARNING", logger="torchrelay"):
        held = survey(RunDir(run), 0, 2)
    assert held is not None and held["parts"] == [], held  # before: the part was offered
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"memory tier refused: {root.parent} on " in lines[0], lines
    assert "is writable by others (mode 0777)" in lines[0], lines


def test_status_lists_nothing_from_a_folder_not_the_users_alone(chosen: Path, tmp_path: Path) -> None:
    from torchrelay.records.summary import _memory_tier

    run = RunDir(tmp_path / "run")
    root = memory_root(LINEAGE, run)
    (root / "checkpoint-7").mkdir(parents=True)
    assert [c["update"] for c in _memory_tier(run, 1, LINEAGE)["checkpoints"]] == [7]
    os.chmod(root.parent, 0o777)
    tier = _memory_tier(run, 1, LINEAGE)
    assert tier["checkpoints"] == [] and f"{root.parent} on " in tier["refused"], tier  # before: listed


def test_the_error_marker_folder_is_checked_by_the_same_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """errors._first_to_say: the rank that makes a launch's marker in /tmp/torchrelay-<uid> says an error every
    rank meets, the others stay quiet. A folder others may write in (here ours, 0777, a marker already planted in
    it) would silence every rank: it is refused by private_dir's check, and every rank then says the error."""
    import tempfile

    from torchrelay import errors

    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(errors, "_launch_key", lambda: "launch-1")
    folder = shared / f"torchrelay-{os.getuid()}"
    assert errors._first_to_say(3) is True and errors._first_to_say(1) is False  # the first rank only
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)
    (folder / "said-launch-2").touch()  # planted by someone who could write there
    monkeypatch.setattr(errors, "_launch_key", lambda: "launch-2")
    assert errors._first_to_say(2) is True and errors._first_to_say(0) is True
