"""How every `belayer bench` command prints its report: JSON (--json) or the benchmark's own table.

Its own module, below cli/bench.py and the benchmarks it registers, so that they share it without
importing each other. Knows nothing about what a report holds.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

# A report is a JSON object whose shape only its own benchmark's table knows: typed as JSON is.
Report = dict[str, Any]


def emit(report: Report, as_json: bool, table: Callable[[Report], None]) -> int:
    """Print a benchmark's report as JSON or as its readable table."""
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        table(report)
    return 0


def percentiles(values: list[float]) -> dict[str, float]:
    """The p50 and p95 of durations in seconds, in milliseconds, and how many there were."""
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p95_ms": round(1000 * p95, 1),
        "n": len(ordered),
    }
