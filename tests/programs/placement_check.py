"""What each server carried of a few training steps: every worker trains a small CNN with
ADTopk for three steps and prints its ledger's bytes pushed to and pulled from each server,
and the parameters' digest, for the test to add up across workers. The argument is the
classes its head has (100: sparsified, as a large model's are; 10: a 20 KB head that
travels dense, a tenth of the step's bytes).

    bpslaunch --local --num-workers 8 --num-servers 8 -- python placement_check.py [100]
"""
import json
import sys

import torch
from torch import nn

import adtopk_ps.torch as bps
from report import digest, say

bps.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                      nn.Flatten(), nn.Linear(2048, 1024), nn.ReLU(),
                      nn.Linear(1024, 512), nn.ReLU(),
                      nn.Linear(512, int(sys.argv[1]) if len(sys.argv) > 1 else 100))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(),
                               compression=bps.Compression.adtopk(ratio=0.01))
bps.broadcast_parameters(model.state_dict(), root_rank=0)
client = bps.client()
before = client.ledger.snapshot()
data = torch.Generator().manual_seed(bps.rank())
for _ in range(3):
    x, y = torch.randn(16, 3, 8, 8, generator=data), torch.randint(0, 10, (16,), generator=data)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
tally = client.ledger.snapshot().since(before)
say("tally " + json.dumps(tally.as_dict()))
say("digest " + digest(model.parameters()))
bps.shutdown()
