"""The soak benchmark's short variant: 8 workers and 4 servers, mixed keys, every sum checked."""
import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_short_soak_checks_every_aggregate_and_memory_stays_flat(tmp_path):
    result = subprocess.run([sys.executable, str(SOAK), "--workers", "8", "--servers", "4",
                             "--rounds", "150", "--timeout", "400", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["every_aggregate_exact"] and summary["grew"] == []
    assert summary["rounds"] == 150 and summary["rounds_per_s"] > 0
    assert 0 < summary["latency_p50_ms"] <= summary["latency_p99_ms"] <= summary["latency_max_ms"]
    # every role was sampled: scheduler, 4 servers, 8 workers
    assert len([r for r, series in summary["rss"].items() if series]) == 13
    assert "| server 3 |" in (tmp_path / "soak.md").read_text()
