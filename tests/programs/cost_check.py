"""Two workers measure the cost model on their own and must route every tensor alike; each
prints the figures it decided from and the tensors it sends dense, then trains 3 steps.

    bpslaunch --local --num-workers 2 ... -- python cost_check.py
"""
import torch

import adtopk_ps.torch as bps


def main() -> None:
    bps.init()
    torch.manual_seed(0)
    # layers of 16 K-590 K elements: around where a key of its own stops paying at local speeds
    model = torch.nn.ModuleList(torch.nn.Linear(256, rows, bias=False)
                                for rows in (64, 128, 256, 512, 1024, 2304))
    compression = bps.GradientCompression("adtopk", measure_costs=True)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   model.named_parameters(), compression)
    cost = compression.policy.cost_model
    dense = sorted(name for name, route in compression.routes.items() if route.dense)
    print(f"worker {bps.rank()}: figures {cost.bytes_per_s!r} {cost.compress_s_per_element!r} "
          f"{cost.key_s!r} dense {dense}", flush=True)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 256)
        sum(layer(x).square().mean() for layer in model).backward()
        opt.step()
    print(f"worker {bps.rank()}: trained", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
