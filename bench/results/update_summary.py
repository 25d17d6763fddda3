"""Set keys of bench/results/summary.json (the registry of headline numbers).

    python bench/results/update_summary.py KEY VALUE DEVICE "COMMAND" [KEY VALUE DEVICE "COMMAND" ...]

Each key maps to {"value", "device", "date", "command"}; the date is today's. Only numbers
that were measured go in: say where the raw result lives in the command text.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

PATH = Path(__file__).with_name("summary.json")


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 4:
        raise SystemExit(__doc__)
    data = json.loads(PATH.read_text()) if PATH.exists() else {}
    today = datetime.date.today().isoformat()
    for i in range(0, len(argv), 4):
        key, value, device, command = argv[i:i + 4]
        data[key] = {"value": float(value), "device": device, "date": today, "command": command}
    PATH.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
