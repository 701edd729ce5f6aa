"""The JSON schemas of a launch plan and a run's configuration, generated from their dataclasses, for editors.

`python -m torchrelay.controller.schemas docs/schema` writes them; tests/test_schema.py checks the committed files
are the generated ones. Point an editor at them, e.g. a first line `# yaml-language-server: $schema=...` in a plan.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torchrelay.config.relay import RelayConfig
from torchrelay.controller.plan import EXTENSION_PREFIX, Plan
from torchrelay.util.schema import json_schema


def schemas() -> dict[str, dict[str, Any]]:
    """{file name: schema} of the configuration and the launch plan."""
    return {
        "relay-config.schema.json": json_schema(
            RelayConfig,
            "torchrelay run configuration",
            "RelayConfig: the fields torchrelay reads from a config file or dict (yours go under params).",
        ),
        "launch-plan.schema.json": _with_extensions(
            json_schema(
                Plan,
                "torchrelay launch plan",
                "The plan YAML of `torchrelay launch` and `torchrelay sbatch`.",
            )
        ),
    }


def _with_extensions(schema: dict[str, Any]) -> dict[str, Any]:
    """The plan's top-level `x-...` keys (YAML anchors, controller.plan.EXTENSION_PREFIX): allowed, anything."""
    pattern = {
        f"^{EXTENSION_PREFIX}": {"description": "yours (YAML anchors to reuse): ignored by torchrelay"}
    }
    at = list(schema).index("additionalProperties")
    items = list(schema.items())
    return dict([*items[:at], ("patternProperties", pattern), *items[at:]])


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs/schema")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        (out / name).write_text(render(schema))
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
