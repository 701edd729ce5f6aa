"""The controller: preflight, smoke and the formal run of a plan, budget-aware, supervised, recorded per attempt."""
