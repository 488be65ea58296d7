"""``python -m server``: the server role (``bpslaunch`` starts it from ``DMLC_ROLE=server``)."""
from adtopk_ps.cluster.stop import exit_when_done

from .service import main

exit_when_done(main())
