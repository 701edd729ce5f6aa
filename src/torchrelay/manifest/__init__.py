"""The data manifest: one JSON object per sample, and a fingerprint that does not change when the data moves.

A manifest may hold ten million samples, so it is never kept as Python objects: `Manifest` keeps where each record's
line lies in the file (and each sample's `length`) in numpy arrays and reads a record when it is asked for. Reading
every line (to check it and compute the fingerprint) costs a few microseconds a line, so a manifest of 32 MB or
more is read by one reader process per core this process may use (at most 16); the run keeps what that pass found
beside its copy of the manifest (`data/manifest.index.npz`, written by the trainer), so a relaunch, every rank but
rank 0, `ledger` and `status` read no line at all, only the file's SHA-256 or not even that. Where a contract is
checked (a resume's rank 0, `ledger`), the index is believed only for the bytes the contract binds (`data.sha256`,
contract.contract_manifest): a copy re-pointed at another data root, or a run made before that field, is read line
by line there.

The package, bottom up: `scan` (the pass over the lines, in this process: checks, fingerprint), `readers` (the
same pass in reader processes, for a big manifest), `index` (the saved index read with care: checked against the
manifest's bytes), `core` (the records, the index saved and loaded, and `scan` choosing between the two passes).
"""

from torchrelay.manifest.core import INDEX_NAME, Manifest, Records, index_path
from torchrelay.manifest.index import INDEX_FORMAT, index_root
from torchrelay.manifest.scan import BOM, FINGERPRINT_VERSION, ROOT_TOKEN

__all__ = [
    "BOM",
    "FINGERPRINT_VERSION",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "ROOT_TOKEN",
    "Manifest",
    "Records",
    "index_path",
    "index_root",
]
