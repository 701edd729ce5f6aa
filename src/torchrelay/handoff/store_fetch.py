"""`prepare s3://bucket/prefix --run-dir DIR`: the bundle downloaded verified (each part checked as it arrives),
beside DIR, then prepared from there as a local bundle is; the download is removed whatever happens."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace

from torchrelay.errors import IntegrityError
from torchrelay.handoff.prepare import PrepareOptions, PrepareResult, prepare
from torchrelay.handoff.store_pack import store_jobs
from torchrelay.handoff.store_read import read_store_bundle
from torchrelay.records.history import new_id
from torchrelay.storage.base import ObjectStore, open_store
from torchrelay.storage.url import StoreURL
from torchrelay.util.hashing import ByteCallback


def prepare_from_store(
    url: StoreURL,
    options: PrepareOptions,
    *,
    on_bytes: ByteCallback | None = None,
    on_files: Callable[[int, int], None] | None = None,
    store: ObjectStore | None = None,
) -> PrepareResult:
    """Download the bundle at `url` verified into a folder beside the run directory, then `prepare` from it;
    a bundle with any problem (not committed, a part that does not match, an unexpected object) is refused before
    the run directory is touched."""
    jobs = store_jobs(options.jobs)
    store = store or open_store(url, jobs=jobs)
    run_dir = options.run_dir.absolute()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = run_dir.parent / f".{run_dir.name}.store-bundle-{new_id()}"
    try:
        report = read_store_bundle(
            store,
            url,
            jobs=jobs,
            dest=staging,
            on_bytes=on_bytes,
            expect=options.expect,
            allowed_signers=options.allowed_signers,
        )
        if not report.ok:
            raise IntegrityError(
                f"{report.problems[0]}"
                + (f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""),
                hint=f"nothing was prepared; `torchrelay verify {url}` lists every problem",
            )
        # the download is ours and temporary: its files are hardlinked into the run directory, not copied again
        return prepare(
            staging,
            replace(options, copy_mode="hardlink", origin=str(url)),
            on_bytes=on_bytes,
            on_files=on_files,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
