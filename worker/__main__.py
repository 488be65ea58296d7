"""``python -m worker --config configs/NAME.yaml``: the training job, under ``bpslaunch``."""
import sys

from .train import main

sys.exit(main())
