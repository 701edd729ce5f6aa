"""Recorded text made safe to show on a terminal: what a run's files (or a bundle's names) hold is hostile input.

A note, a host or a reason printed as it is sent its ESC and other control characters to whoever reads the output:
`\\x1b]0;...\\x07` retitles the terminal, `\\x1b[2J` clears it, `\\x1b[1A` moves the cursor over the lines above.
"""

from __future__ import annotations

import unicodedata

from rich.markup import escape


def _char(c: str) -> str:
    return repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c


def visible(value: object) -> str:
    """`str(value)` with every control character (C0, DEL, C1; a newline and a tab too: a recorded value is shown
    on one line) written as `repr` writes it (`\\x1b`, `\\n`), for plain `print`."""
    text = str(value)
    return text if text.isprintable() else "".join(map(_char, text))


def shown(value: object) -> str:
    """`visible(value)` with rich's markup escaped, for `Console.print` and tables: `[/]` is text, not a tag."""
    return escape(visible(value))
