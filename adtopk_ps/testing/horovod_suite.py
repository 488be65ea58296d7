"""Run horovod's own PyTorch tests against ``adtopk_ps.torch``, whole, in one local cluster.

    python -m adtopk_ps.testing.horovod_suite HOROVOD_CHECKOUT [--workers 2] [--servers 1]

``HOROVOD_CHECKOUT`` is a horovod source tree (it needs ``test/parallel/test_torch.py``
and ``test/utils/common.py``). Only the import changes: a package named ``horovod``,
written to a temporary folder, is ``adtopk_ps.torch``. The tests run as horovod runs
them: every one of :data:`OFFERED` (the tests whose names docs/compatibility.md offers)
in one pytest process per worker, under one ``bpslaunch --local`` cluster, so one test's
refused call must not poison the next. Each worker gets ``HOROVOD_RANK`` and
``HOROVOD_SIZE`` as ``horovodrun --gloo`` sets them. Two adjustments are the test file's,
for the Python and torch installed here: ``inspect.getargspec`` (gone in Python 3.11) is
``getfullargspec``, and torch's ``Muon`` (2-D parameters only, newer than the tests) is
left out of the optimizers the state tests sweep. Exits with ``bpslaunch``'s status.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

OFFERED = (
    "test_allgather_object", "test_broadcast_object", "test_broadcast_state",
    "test_broadcast_state_no_grad", "test_broadcast_state_options", "test_compression_fp16",
    "test_duplicate_names", "test_dynamic_requires_grad", "test_force_allreduce",
    "test_gradient_clipping", "test_horovod_allgather", "test_horovod_allgather_async_fused",
    "test_horovod_allgather_duplicate_name_error", "test_horovod_allgather_error",
    "test_horovod_allgather_grad", "test_horovod_allgather_type_error",
    "test_horovod_allgather_variable_size", "test_horovod_allreduce",
    "test_horovod_allreduce_async_fused", "test_horovod_allreduce_average",
    "test_horovod_allreduce_duplicate_name_error", "test_horovod_allreduce_error",
    "test_horovod_allreduce_grad", "test_horovod_allreduce_inplace",
    "test_horovod_allreduce_postscale", "test_horovod_allreduce_prescale",
    "test_horovod_allreduce_type_error", "test_horovod_broadcast",
    "test_horovod_broadcast_duplicate_name_error", "test_horovod_broadcast_error",
    "test_horovod_broadcast_grad", "test_horovod_broadcast_inplace",
    "test_horovod_broadcast_rank_error", "test_horovod_broadcast_type_error",
    "test_horovod_is_initialized", "test_horovod_join_allgather", "test_horovod_join_allreduce",
    "test_horovod_join_broadcast", "test_horovod_rank", "test_horovod_reinit",
    "test_horovod_size", "test_missing_named_parameters", "test_no_named_parameters",
    "test_synchronize_step_warning",
)

# the package the tests import, and what their helper module imports at load time
SHIM = {
    "horovod/__init__.py": '''"""adtopk_ps.torch under horovod's name, for horovod's own tests."""
import inspect

import torch.optim as optim  # (not "torch": the subpackage horovod.torch takes that name here)

if not hasattr(inspect, "getargspec"):  # Python 3.11 removed it; the tests call it
    inspect.getargspec = inspect.getfullargspec
if hasattr(optim, "Muon"):  # newer than the tests, which build every optimizer
    optim.Optimizer.__subclasses__ = staticmethod(
        lambda: [c for c in type.__subclasses__(optim.Optimizer) if c.__name__ != "Muon"])
''',
    "horovod/torch/__init__.py": "from adtopk_ps.torch import *  # noqa: F401,F403\n",
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": '''import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """horovod's helper, which the tests' common.py imports."""
    thread = threading.Thread(target=target, args=args if isinstance(args, tuple) else (args,),
                              name=name, daemon=daemon)
    thread.start()
    return thread
''',
    "mock.py": "from unittest.mock import *  # noqa: F401,F403\n",
}

# each worker: horovod's rank variables, then pytest on the offered tests
WORKER = '''import os
import sys

import pytest

os.environ["HOROVOD_RANK"] = os.environ["DMLC_WORKER_ID"]
os.environ["HOROVOD_SIZE"] = os.environ["DMLC_NUM_WORKER"]
sys.exit(pytest.main(["-p", "no:cacheprovider", "-q", "-rfE", "--rootdir", sys.argv[1],
                      "-c", os.devnull, *sys.argv[2:]]))
'''


def write_shim(folder: Path) -> None:
    """Write the ``horovod`` package (and ``mock``) that :data:`SHIM` holds into ``folder``."""
    for relative, text in SHIM.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run(checkout: Path, workers: int = 2, servers: int = 1,
        tests: Sequence[str] = OFFERED) -> int:
    """Run ``tests`` of the checkout's test_torch.py in one cluster; returns the exit status.

    Example::

        status = run(Path("~/src/horovod").expanduser())
    """
    suite = checkout / "test" / "parallel" / "test_torch.py"
    helpers = checkout / "test" / "utils"
    if not suite.is_file() or not (helpers / "common.py").is_file():
        raise FileNotFoundError(f"{checkout} has no test/parallel/test_torch.py and "
                                f"test/utils/common.py: give a horovod source tree")
    with tempfile.TemporaryDirectory(prefix="horovod-suite-") as tmp:
        folder = Path(tmp)
        write_shim(folder)
        (folder / "worker.py").write_text(WORKER)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(folder), str(helpers), os.environ.get("PYTHONPATH", "")])}
        ids = [f"{suite}::TorchTests::{name}" for name in tests]
        command = [sys.executable, "-m", "adtopk_ps.launcher", "--local",
                   "--num-workers", str(workers), "--num-servers", str(servers), "--",
                   sys.executable, str(folder / "worker.py"), str(suite.parent), *ids]
        return subprocess.run(command, env=env).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: see the module's docstring."""
    ap = argparse.ArgumentParser(prog="python -m adtopk_ps.testing.horovod_suite",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="a horovod source tree")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        return run(args.checkout, args.workers, args.servers)
    except FileNotFoundError as exc:
        print(f"horovod_suite: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
