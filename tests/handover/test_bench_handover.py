"""`belayer bench handover` end to end, at the smallest size: its report is whole and says what it measured.

The figures themselves are the benchmark's business (docs/benchmarks.md); this checks that every
part of it still runs against the cluster as it is now, which a benchmark nobody runs can stop
doing unnoticed: its cold restart once hung for want of the bus's credentials.
"""

from __future__ import annotations

import json

from tests.cli.helpers import belayer

KILLS = 2


def test_bench_handover_measures_every_part() -> None:
    done = belayer(
        "bench", "handover", "--presets", "tiny", "--kills", str(KILLS), "--cold-starts", "1",
        "--rounds", "1", "--requests", "2", "--max-tokens", "8", "--json",
        timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)["presets"]["tiny"]
    handover, cold = figures["handover"], figures["cold_restart"]
    assert handover["shadow_path"] == KILLS  # every kill taken over by the shadow, none cold
    assert handover["time_to_ready"]["n"] == KILLS and cold["time_to_ready"]["n"] == 1
    # A cold start imports torch and builds the model; a promotion does neither.
    assert cold["time_to_ready"]["p50_ms"] > handover["time_to_ready"]["p50_ms"] > 0
    assert figures["first_resumed_token"]["kill_to_next_token_ms"] > 0
    assert figures["shadow_cost"]["tokens_per_s_with_shadow"] > 0
