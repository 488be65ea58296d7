"""The load generator (benchmarks/loadgen.py) on a small real cluster: 4 synthetic workers in
two driver processes, 2 real servers and a real scheduler, replaying ADTopk pushes recorded
from the digits CNN's real gradients. Every answer must be the sum of the pushes replayed in
its round (computed here, from the recording), the bytes it counts must be the bytes it
replayed and what the kernel carried, and every process it started must be gone."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import msgpack
import torch

from adtopk_ps import wire

ROOT = Path(__file__).resolve().parents[1]
WORKERS, SERVERS, WARMUP, ROUNDS = 4, 2, 1, 3
# zmq's framing on a connection, beyond the frames' bytes: the greeting and handshake, a
# flag and length per frame, and heartbeats; bounds, not estimates
HANDSHAKE_BYTES, FRAME_BYTES, HEARTBEATS_BYTES = 512, 9, 4096


def run_loadgen(tmp_path: Path) -> dict:
    config = tmp_path / "digits.yaml"  # the main job's model and data, at its batch size
    config.write_text("model: cnn\nmodel_args: {}\ndataset: digits\nbatch_size: 32\n"
                      "optimizer: {name: sgd, lr: 0.05}\nmin_compress_bytes: 65536\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loadgen.py"), "--config", str(config),
         "--at", "5", "--feedback-steps", "1", "--steps", "2", "--workers", str(WORKERS),
         "--servers", str(SERVERS), "--placements", "djb2", "--warmup", str(WARMUP),
         "--rounds", str(ROUNDS), "--repeats", "1", "--keep", str(tmp_path / "keep"),
         "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def test_answers_bytes_and_processes(tmp_path):
    result = run_loadgen(tmp_path)
    (row,) = result["rows"]
    (run,) = row["runs"]
    keep = tmp_path / "keep" / f"W{WORKERS}-djb2-S{SERVERS}-r0"
    recording = pickle.loads((keep / "recording.pkl").read_bytes())
    keys, pushes = recording["keys"], recording["pushes"]
    assert len(pushes) == WORKERS and len(keys) >= 2
    rounds = WARMUP + ROUNDS

    # every answer, as each driver's workers got it, is the sum of that round's pushes
    for driver in (0, 1):
        answers = pickle.loads((keep / f"answers{driver}.pkl").read_bytes())
        assert set(answers) == {(r, i) for r in range(rounds) for i in range(len(keys))}
        for (rnd, index), frames in answers.items():
            total = torch.zeros(wire.decode(pushes[0][0][index]).payload.shape, dtype=torch.float64)
            magnitude = torch.zeros_like(total)
            for w in range(WORKERS):
                payload = wire.decode(pushes[w][rnd % len(pushes[w])][index]).payload
                dense = payload.decompress().double()
                total += dense
                magnitude += dense.abs()
            answer = wire.decode(frames)
            assert (answer.op, answer.key, answer.round) == (wire.Op.RESULT, keys[index]["key"], rnd)
            got = answer.payload.decompress().double()
            # float32 additions in the server's order: within (W - 1) units of rounding of the
            # magnitudes' sum; zero exactly where nothing was pushed
            assert torch.all((got - total).abs() <= (WORKERS - 1) * 2.0 ** -24 * magnitude)
            assert torch.equal(got[magnitude == 0], total[magnitude == 0])
            assert int((got != 0).sum()) >= int((total.abs() > WORKERS * 2.0 ** -24 * magnitude).sum())

    # the bytes counted are the bytes replayed, and what the kernel carried for them
    for server, figures in enumerate(run["per_server"]):
        replayed = sum(len(msgpack.packb(dict(msgpack.unpackb(pushes[w][r % 2][i][0]), round=r)))
                       + sum(len(f) for f in pushes[w][r % 2][i][1:])
                       for w in range(WORKERS) for r in range(rounds)
                       for i, k in enumerate(keys) if k["server"] == server)
        answered = WORKERS * sum(len(f) for (r, i), frames in answers.items()
                                 if keys[i]["server"] == server for f in frames)
        counted, kernel = figures["counted_all"], figures["kernel_all"]
        messages = counted["pushes"]
        assert counted["in"] == replayed and counted["out"] == answered
        framing = WORKERS * (HANDSHAKE_BYTES + HEARTBEATS_BYTES) + messages * FRAME_BYTES * 4
        assert counted["in"] < kernel["in"] <= counted["in"] + framing
        assert counted["out"] < kernel["out"] <= counted["out"] + framing
        assert messages == WORKERS * rounds * sum(k["server"] == server for k in keys)

    # every process the run started has exited and been reaped
    assert set(run["pids"]) == {"scheduler", "server0", "server1", "driver0", "driver1"}
    for pid in run["pids"].values():
        assert not os.path.exists(f"/proc/{pid}"), f"process {pid} is still there"
    assert result["answers_checked"] == 2 * rounds * len(keys)
