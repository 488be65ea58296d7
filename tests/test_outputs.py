"""The job's outputs on a full disk: the metrics log and the summary name their file and the
reason (the training job prints that one line and exits 1), and leave no buffer to fail again
at exit."""
import subprocess
import sys

import pytest

from worker.outputs import MetricsLog, OutputError, write_summary


def test_a_full_disk_under_the_metrics_log_and_the_summary_is_named(small_disk):
    folder, resize = small_disk
    resize(64 * 1024)
    (folder / "filler").write_bytes(b"x" * (60 * 1024))
    log = MetricsLog(str(folder / "metrics.jsonl"))
    with pytest.raises(OutputError, match=rf"writing {folder}/metrics.jsonl failed \(No space left on device\)"):
        for step in range(10_000):
            log.append({"step": step, "loss": 0.5, "note": "x" * 100})
    log.close()
    with pytest.raises(OutputError, match=rf"writing {folder}/summary.json failed \(No space left on device\)"):
        write_summary(str(folder / "summary.json"), {"accuracy": 0.9, "pad": "y" * 100_000})


def test_a_failed_metrics_write_leaves_nothing_to_flush_at_exit(small_disk):
    """The file is unbuffered: the process that caught the error exits without a second one."""
    folder, resize = small_disk
    resize(64 * 1024)
    (folder / "filler").write_bytes(b"x" * (64 * 1024 - 100))
    program = ("import sys\nfrom worker.outputs import MetricsLog, OutputError\n"
               f"log = MetricsLog({str(folder / 'm.jsonl')!r})\n"
               "try:\n    log.append({'pad': 'x' * 50000})\nexcept OutputError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "No space left on device" in out.stdout, out
    assert out.stderr == "", out.stderr
