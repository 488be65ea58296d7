"""benchmarks/machinery.py runs, a real cluster included, and its lines add up (figures are not asserted)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\]"
PARTS = ["compress+ef", "encode", "decode+restore", "engine"]


def test_machinery_prints_every_part_of_every_model_and_ends_with_the_whole():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "machinery.py"), "--quick", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    whole = re.fullmatch(rf"machinery \(vgg16, bert-base\): {NUMBER}x read-once", lines[-1])
    assert whole, lines[-1]
    spans = []
    for model in ("vgg16", "bert-base"):
        mine = [line for line in lines if line.startswith(model + " ")]
        assert [line.split(":")[0] for line in mine] == \
            [f"{model} {part}" for part in ["read-once", *PARTS, "machinery"]], mine
        read = re.match(rf"{model} read-once: {NUMBER} ns/element \((\d+) elements, (\d+) keys, (\d+) sparse\)",
                        mine[0])
        assert read and float(read.group(1)) > 0, mine[0]
        assert 0 < int(read.group(6)) < int(read.group(5)), mine[0]  # the policy sends some keys dense
        parts = [re.match(rf"{model} [\w+]+: {NUMBER} ns/element, {NUMBER}x read-once", line) for line in mine[1:]]
        assert all(parts), mine
        for m in parts:
            median, low, high = (float(v) for v in m.groups()[:3])
            assert low <= median <= high
        # every repeat's machinery is the sum of its parts: its range lies within theirs
        total = parts[-1]
        assert sum(float(m.group(2)) for m in parts[:-1]) <= float(total.group(2)) * 1.001 + 1e-3
        assert float(total.group(3)) <= sum(float(m.group(3)) for m in parts[:-1]) * 1.001 + 1e-3
        compress = parts[0]
        assert float(compress.group(4)) > 0  # compressing costs something next to a read
        spans.append((float(total.group(5)), float(total.group(6))))
    # both models' repeats together: each repeat's whole lies between the models' ratios
    assert min(s[0] for s in spans) * 0.999 <= float(whole.group(1)) <= max(s[1] for s in spans) * 1.001
