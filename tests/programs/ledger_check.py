"""What the ledger says after one sparse and one dense push_pull: every worker prints its
tally as JSON for the test to check.

    bpslaunch --local --num-workers 2 --num-servers 2 -- python ledger_check.py
"""
import json

import torch

import adtopk_ps.torch as bps
from adtopk_ps.compression import create
from report import say

bps.init()
client, rank = bps.client(), bps.rank()
before, pushed, pulled = client.ledger.snapshot(), client.bytes_pushed, client.bytes_pulled
# top-k keeps 100 of 20,000: worker r's largest are 50r..50r+99, so two workers' overlap by 50
grad = torch.zeros(400, 50)
grad.view(-1)[50 * rank:50 * rank + 100] = 10.0 + torch.arange(100.0)
client.push_pull(grad, "ledger.sparse", create({"compressor": "topk", "k": 0.005})).wait()
client.push_pull(torch.ones(3000), "ledger.dense").wait()
tally = client.ledger.snapshot().since(before)
say("tally " + json.dumps({**tally.as_dict(), "bytes_pushed": client.bytes_pushed - pushed,
                           "bytes_pulled": client.bytes_pulled - pulled,
                           "answer_density": tally.answer_density}))
bps.shutdown()
