"""What the worker's client raises to its caller, in one place: a server's refusal, a
collective refused on every worker, and the membership changing under an elastic job.
Each is raised by the client (engine.py, ps_client.py) and caught by the layers above
(``adtopk_ps.torch``, the training job), which import them from here."""
from __future__ import annotations

__all__ = ["CollectiveError", "HostsUpdatedInterrupt", "MembershipChanged", "PushPullError"]


class PushPullError(RuntimeError):
    """A server refused one of this worker's pushes."""


class MembershipChanged(RuntimeError):
    """The workers changed (an elastic job re-formed: a worker lost or joined): every push and
    collective in flight was abandoned, and every call fails with this until the caller
    acknowledges it (:meth:`~adtopk_ps.client.ps_client.PSClient.acknowledge_membership`),
    having gone back to its last committed state (``adtopk_ps.torch.elastic``)."""


class HostsUpdatedInterrupt(MembershipChanged):
    """The workers changed by joins only: nothing was lost, though the step in flight was
    abandoned all the same (horovod's name; caught wherever :class:`MembershipChanged` is)."""


class CollectiveError(RuntimeError):
    """A collective refused on every worker alike: the workers' calls differ, one worker's
    side failed, a worker finished or waits elsewhere, or one joined. The job goes on."""
