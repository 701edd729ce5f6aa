"""Decisions as small pure objects fed a context: when to stop, and whether there is time for more."""
