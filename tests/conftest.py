import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=100, derandomize=False)
settings.load_profile("ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)
