"""Role processes started by bpslaunch reuse the memory they free (counted in page faults)."""
import os
import subprocess
import sys

from adtopk_ps.allocator import TUNABLES, keep_freed_memory

# the page faults of six training steps of a two-layer net (32 MiB of weights), after four to
# settle in: how many steps the heap takes to reach its peak differs between machines
FAULTS = ("import resource, torch\n"
          "torch.set_num_threads(1)\n"
          "net = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048))\n"
          "x = torch.randn(256, 2048)\n"
          "def step():\n"
          "    net.zero_grad()\n"
          "    net(x).square().mean().backward()\n"
          "for _ in range(4):\n"
          "    step()\n"
          "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
          "for _ in range(6):\n"
          "    step()\n"
          "print('faults', resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")


def faults(env):
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def plain_env():
    return {k: v for k, v in os.environ.items()
            if k not in TUNABLES.values() and k not in ("GLIBC_TUNABLES", "PS_KEEP_FREED_MEMORY")}


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    default, kept = faults(plain_env()), faults(keep_freed_memory(plain_env()))
    assert default > 6 * 8_192  # each step faults at least one 32 MiB gradient in again
    assert kept < default / 4  # seen: 98,000-105,000 faults by default, 0-3,073 kept


def test_the_user_can_turn_it_off_or_tune_it_themselves():
    assert keep_freed_memory({"PS_KEEP_FREED_MEMORY": "0"}) == {"PS_KEEP_FREED_MEMORY": "0"}
    threshold = str(1 << 32)
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1"}) == {
        "MALLOC_TRIM_THRESHOLD_": "1", "GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={threshold}"}
    # other tunables are kept, and a threshold the user gives is theirs
    mixed = keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=7"})
    assert mixed["GLIBC_TUNABLES"] == ("glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=7:"
                                       f"glibc.malloc.mmap_threshold={threshold}")


def test_bpslaunch_workers_get_it():
    # role mode: the worker command needs no cluster to count its own page faults
    env = {**plain_env(), "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "BYTEPS_LOCAL_SIZE": "1"}
    result = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", sys.executable, "-c", FAULTS],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split("faults")[-1].split()[0]) < faults(plain_env()) / 4
