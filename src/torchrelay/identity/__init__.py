"""Who trained what: the code's identity and the versions in use.

`code`: the identity (commit, tree, the program's own files) and the code directory of a script; `files`: a tree's
files as git sees them, with or without git; `changes`: the one rule of what refuses a resume; `node`: the versions
and program files every node must share with rank 0's. The names below are the package's API.
"""

from torchrelay.identity.changes import CODE_FIELDS, code_changes, tree_note
from torchrelay.identity.code import code_identity, find_code_dir, running_files
from torchrelay.identity.node import (
    fingerprint_differences,
    fingerprint_summary,
    node_fingerprint,
    versions,
)

__all__ = [
    "CODE_FIELDS",
    "code_changes",
    "code_identity",
    "find_code_dir",
    "fingerprint_differences",
    "fingerprint_summary",
    "node_fingerprint",
    "running_files",
    "tree_note",
    "versions",
]
