"""Where things are: the one name table, the run directory and bundle as typed paths, the writer's lock,
and where a copy may go."""
