"""Generic helpers with no knowledge of runs or bundles: hashing, canonical JSON, dotted keys,
safe relative paths, progress bars."""
