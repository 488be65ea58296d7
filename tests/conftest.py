import pytest
import torch
from hypothesis import settings

import adtopk_ps.torch as bps
from adtopk_ps.torch.runtime import close
from procs import roles

settings.register_profile("ci", deadline=None, max_examples=100, derandomize=False)
settings.load_profile("ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def session():
    """adtopk_ps.torch initialised in this process against a real scheduler and server."""
    with roles(1, 1) as (config, _):
        bps.init(config=config)
        yield
        close()
