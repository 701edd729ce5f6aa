"""The exposure ledger: proof that every sample was seen once, in order; its proof file and background prover."""
