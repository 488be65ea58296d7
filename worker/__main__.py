"""``python -m worker --config configs/NAME.yaml``: the training job, under ``bpslaunch``."""
from adtopk_ps.cluster.stop import exit_when_done

from .train import main

exit_when_done(main())
