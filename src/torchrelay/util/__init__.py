"""Generic helpers with no knowledge of runs or bundles: hashing, safe relative paths, progress bars."""
