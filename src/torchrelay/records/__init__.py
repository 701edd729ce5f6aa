"""What a run directory records of its run: the contract, the history of segments, the per-rank train and
validation logs, digests, how a segment ended, and the summary read back from them."""
