"""The compression benchmark runs and reports every compressor (figures are not asserted)."""
import re
import subprocess
import sys
from pathlib import Path

from adtopk_ps.compression import COMPRESSORS

ROOT = Path(__file__).resolve().parents[1]


def test_compression_benchmark_prints_a_row_per_compressor():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--shapes", "32x600",
         "--densities", "0.01", "--budget", "0.01"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    for name in COMPRESSORS:
        assert re.search(rf"^\| {re.escape(name)} \| [\d.]+ \|", out, re.M), name
    row = re.search(r"^\| \(32, 600\) \| 0.01 \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert row and float(row.group(1)) > 0
    # ADTopk keeps max(1, floor(600 * 0.01)) = 6 values per row with uint16 positions
    adtopk = re.search(r"^\| adtopk \|.*\| ([\d,]+) \|$", out, re.M)
    values_and_indices = 32 * 6 * (4 + 2)
    assert values_and_indices < int(adtopk.group(1).replace(",", "")) < values_and_indices + 200
