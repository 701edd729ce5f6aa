"""The kernel's memory counters (Linux's /proc/meminfo), read one way for every caller."""

from __future__ import annotations


def meminfo_kib(*names: str) -> dict[str, int] | None:
    """The named fields of /proc/meminfo in KiB (e.g. "MemAvailable", "Dirty"), or None where the file or a field
    is not there to read (not Linux, an older kernel)."""
    wanted, got = set(names), {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in wanted:
                    got[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return got if len(got) == len(wanted) else None
