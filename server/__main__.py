"""``python -m server``: the server role (``bpslaunch`` starts it from ``DMLC_ROLE=server``)."""
import sys

from .service import main

sys.exit(main())
