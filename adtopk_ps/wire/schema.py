"""The header fields a payload may have, and their msgpack types.

Kept apart from the payload's code, which needs torch: the scheduler reads and writes
messages that carry no tensor, and starts without importing torch.
"""
from __future__ import annotations

#: the fields every payload has
REQUIRED = {"codec": str, "shape": list, "dtype": str, "vdtype": str, "count": int}
_OPTIONAL = {"idtype": str, "view": list, "k": int, "seed": int, "rows": int, "rowset": str}
#: every field a payload may have
PAYLOAD_FIELDS = {**REQUIRED, **_OPTIONAL}
