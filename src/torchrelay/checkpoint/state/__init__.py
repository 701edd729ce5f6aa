"""What a checkpoint holds besides its commit protocol, and how each part is written and read: DCP tensors, JSON,
safetensors — never a pickle, except the files of a DeepSpeed engine's own checkpoint (deepspeed_engine.py).

`records`: the state's files, their formats and readers; `trees`: a stateful's state as JSON with its tensors set
aside; `document`: model and optimizer as DCP's document; `save`: capture at the update, write on any thread;
`load`: everything a rank holds, checked on the way. The names below are the package's API.
"""

from torchrelay.checkpoint.state.document import (
    STATE_DICT_OPTIONS,
    dcp_document,
    join_optimizer,
    split_optimizer,
)
from torchrelay.checkpoint.state.load import load_rng, load_state
from torchrelay.checkpoint.state.records import (
    LEGACY_STATE,
    MODEL_DIR,
    OPTIMIZER_SCHEMA,
    PER_RANK_SCHEMA,
    RANK_STATE_DIR,
    RANK_STATE_FORMAT,
    RANK_STATE_SCHEMA,
    READABLE_FORMATS,
    RELAY_STATE,
    STATE_FORMAT,
    STATE_SCHEMA,
    STATE_TENSORS,
    Stateful,
    json_bytes,
    per_rank_of,
    rank_state_file,
    read_rank_statefuls,
    read_tensors,
    read_trainer_state,
    safetensors_save,
    state_path,
)
from torchrelay.checkpoint.state.save import Snapshot, capture_state, reserve, save_state, write_snapshot
from torchrelay.checkpoint.state.trees import from_tree, to_tree, tree_of

__all__ = [
    "LEGACY_STATE",
    "MODEL_DIR",
    "OPTIMIZER_SCHEMA",
    "PER_RANK_SCHEMA",
    "RANK_STATE_DIR",
    "RANK_STATE_FORMAT",
    "RANK_STATE_SCHEMA",
    "READABLE_FORMATS",
    "RELAY_STATE",
    "STATE_DICT_OPTIONS",
    "STATE_FORMAT",
    "STATE_SCHEMA",
    "STATE_TENSORS",
    "Snapshot",
    "Stateful",
    "capture_state",
    "dcp_document",
    "from_tree",
    "join_optimizer",
    "json_bytes",
    "load_rng",
    "load_state",
    "per_rank_of",
    "rank_state_file",
    "read_rank_statefuls",
    "read_tensors",
    "read_trainer_state",
    "reserve",
    "safetensors_save",
    "save_state",
    "split_optimizer",
    "state_path",
    "to_tree",
    "tree_of",
    "write_snapshot",
]
