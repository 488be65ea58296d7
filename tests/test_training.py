"""The training job on real local clusters: learning, identical replicas, broadcast, resume."""
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from procs import DIGITS_CNN as CONFIG
from procs import bpslaunch
from procs import checksums as _checksums
from procs import train_job as _train

ROOT = Path(__file__).resolve().parents[1]


def test_2x2_learns_and_keeps_every_replica_identical(tmp_path):
    metrics, summary = tmp_path / "metrics.jsonl", tmp_path / "summary.json"
    result = _train(2, 2, "--steps", "60", "--checksums", "--set", "eval_every=10",
                    "--metrics", str(metrics), "--metrics-out", str(summary))
    assert result.returncode == 0, result.stdout[-3000:]
    by_step = _checksums(result.stdout)
    assert sorted(by_step) == list(range(1, 61))
    assert all(len(set(d.values())) == 1 and len(d) == 2 for d in by_step.values())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert records[-1]["test_loss"] < records[0]["test_loss"] / 2
    assert records[-1]["accuracy"] > 0.8
    assert records[-1]["bytes_pushed"] > records[0]["bytes_pushed"] > 0
    final = json.loads(summary.read_text())
    assert {"accuracy", "loss", "steps", "samples_per_s", "bytes_pushed", "bytes_pulled",
            "compressor", "wall_s"} <= set(final)
    assert final["compressor"] == "adtopk" and final["steps"] == 60
    assert "summary: accuracy=" in result.stdout
    assert not warnings(result.stdout), warnings(result.stdout)


def warnings(output: str) -> list[str]:
    """The lines of a job's output that warn: Python's warnings and log records at WARNING."""
    return [line for line in output.splitlines() if "Warning" in line or " WARNING " in line]


def test_dense_tensors_all_reduced_among_the_workers_train_bit_for_bit_alike(tmp_path):
    """``dense_transport: allreduce`` changes the route of the CNN's dense tensors, not a bit
    of the training (two workers' sum is exact either way), and says what it moved."""
    runs = {}
    for transport in ("ps", "allreduce"):
        summary = tmp_path / f"{transport}.json"
        result = _train(2, 2, "--steps", "20", "--checksums", "--set", f"dense_transport={transport}",
                        "--metrics-out", str(summary))
        assert result.returncode == 0, result.stdout[-3000:]
        runs[transport] = (_checksums(result.stdout), json.loads(summary.read_text()))
    (ps, ps_summary), (ring, ring_summary) = runs["ps"], runs["allreduce"]
    assert sorted(ps) == list(range(1, 21)) and ps == ring
    assert all(len(set(d.values())) == 1 and len(d) == 2 for d in ring.values())
    assert ps_summary["bytes_allreduced"] == 0 < ring_summary["bytes_allreduced"]
    # the dense tensors left the servers' traffic; the sparse ones still go through them
    assert 0 < ring_summary["bytes_pushed"] < ps_summary["bytes_pushed"]


def test_broadcast_makes_differently_initialised_workers_equal():
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "2", "--", sys.executable,
                       str(ROOT / "tests" / "programs" / "broadcast_check.py"))
    assert result.returncode == 0, result.stdout[-3000:]
    before = dict(re.findall(r"before (\d) (\w+)", result.stdout))
    after = re.findall(r"after (\d) (\w+) (\w+) (lr=\S+ batches=\d+)", result.stdout)
    assert len(set(before.values())) == 3  # they really did start apart
    assert len(after) == 3 and len({a[1:] for a in after}) == 1
    assert after[0][1] == before["0"]  # everyone now holds the root's weights
    assert after[0][3] == "lr=0.05 batches=1"
    objects = re.findall(r"objects (\d) (.*)", result.stdout)
    assert sorted(r for r, _ in objects) == ["0", "1", "2"]
    assert {line for _, line in objects} == {"0.1 root [0, 1, 2] [0, 7, 14]"}


def test_resumed_run_continues_from_the_same_step_with_identical_state(tmp_path):
    straight = _train(2, 1, "--steps", "40", "--checksums")
    assert straight.returncode == 0, straight.stdout[-3000:]
    first = _train(2, 1, "--steps", "40", "--checksums", "--stop-after", "20",
                   "--checkpoint-dir", str(tmp_path))
    assert first.returncode == 0, first.stdout[-3000:]
    assert sorted(_checksums(first.stdout)) == list(range(1, 21))
    resumed = _train(2, 1, "--steps", "40", "--checksums", "--checkpoint-dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    want, got = _checksums(straight.stdout), _checksums(resumed.stdout)
    assert sorted(got) == list(range(21, 41))  # it picked up at step 21
    for step in range(21, 41):
        assert got[step] == want[step], step  # model, optimizer and residuals all came back


def test_every_config_runs(tmp_path):
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        summary = tmp_path / f"{config.stem}.json"
        elastic = yaml.safe_load(config.read_text()).get("elastic")  # its cluster's bounds
        shape = ("--num-workers", str(elastic["min_workers"]), "--min-workers",
                 str(elastic["min_workers"])) if elastic else ("--num-workers", "1")
        result = bpslaunch("--local", *shape, "--num-servers", "1", "--timeout", "200",
                           "--", sys.executable, "-m", "worker", "--config", str(config),
                           "--steps", "2", "--set", "batch_size=4", "--metrics-out", str(summary),
                           timeout=240)
        assert result.returncode == 0, (config.name, result.stdout[-3000:])
        final = json.loads(summary.read_text())
        assert final["steps"] == 2 and final["bytes_pushed"] > 0, config.name
        assert not warnings(result.stdout), (config.name, warnings(result.stdout))


def test_bad_config_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: cnn\nlearning_rate: 3\n")
    result = subprocess.run([sys.executable, "-m", "worker", "--config", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "config key learning_rate: unknown key" in result.stderr


def test_policy_density_follows_the_compressor_however_the_config_spells_it():
    from worker.config import DEFAULTS
    from worker.train import make_compression
    for spec in ({"compressor": "adtopk"}, {"compressor": "adtopk", "k": 0.05},
                 {"compressor": "topk", "ratio": 0.2}, "randomk"):
        compression = make_compression({**DEFAULTS, "compression": spec})
        assert compression.policy.ratio == compression.compressor.ratio
    assert make_compression({**DEFAULTS, "compression": {"compressor": "none"}}).compressor is None


def test_a_job_killed_by_a_lost_server_resumes_from_its_last_checkpoint(tmp_path):
    """A server is SIGKILLed mid-run: the job ends naming it. Relaunched with the same
    config, it continues from the last checkpoint with the parameters, optimizer state and
    residuals an uninterrupted run has at that step (equal checksums from there on)."""
    import os
    import signal
    import time

    from procs import FAST
    straight = _train(2, 1, "--steps", "40", "--checksums")
    assert straight.returncode == 0, straight.stdout[-3000:]
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "2",
           "--num-servers", "1", "--timeout", "200", "--", sys.executable, "-m", "worker",
           "--config", CONFIG, "--steps", "40", "--checksums", "--checkpoint-dir", str(tmp_path),
           "--set", "checkpoint_every=5"]
    launcher = subprocess.Popen(cmd, env={**os.environ, **FAST}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines, killed_at = [], None
    try:
        for line in launcher.stdout:
            lines.append(line)
            if killed_at is None and re.search(r"checksum step 17:", line):
                ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(launcher.pid)],
                                    capture_output=True, text=True).stdout
                server = next(int(row.split()[0]) for row in ps.splitlines() if "-m server" in row)
                os.kill(server, signal.SIGKILL)
                killed_at = time.monotonic()
        launcher.wait(60)
    finally:
        launcher.kill()
    out = "".join(lines)
    assert killed_at is not None, out[-3000:]
    assert launcher.returncode != 0 and time.monotonic() - killed_at < 20
    assert re.search(r"server 0 \(tcp://127\.0\.0\.1:\d+\) lost", out), out[-3000:]
    reached = max(_checksums(out))
    assert 17 <= reached < 40
    resumed = _train(2, 1, "--steps", "40", "--checksums", "--checkpoint-dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    want, got = _checksums(straight.stdout), _checksums(resumed.stdout)
    start = min(got)
    assert start == 5 * (reached // 5) + 1 or start == 5 * ((reached - 1) // 5) + 1, (start, reached)
    assert sorted(got) == list(range(start, 41))
    for step in range(start, 41):
        assert got[step] == want[step], step


def test_unfreezing_a_layer_mid_run_keeps_the_replicas_equal():
    """The backbone is frozen when DistributedOptimizer is built and unfrozen at step 2 (the
    head frozen at step 4), every worker on its own data: the optimizer picks the change up
    on every worker, and the replicas stay equal at every step; verify_replicas then passes,
    and names the parameter once one worker's copy drifts."""
    program = Path(__file__).resolve().parent / "programs" / "unfreeze_check.py"
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--",
                       sys.executable, str(program), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    for worker in range(2):
        lines = [line for line in result.stdout.splitlines()
                 if line.startswith(f"[worker {worker}] worker {worker}: ")]
        assert len(lines) == 9 and all(line.endswith(" ok") for line in lines), lines
