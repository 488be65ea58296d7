"""Membership and transport: who is in the job, and how messages reach them.

ps-lite's Postoffice and Van. ``membership`` reads a role's place in the job
from the environment and forms the job; ``scheduler`` is the role that forms
it, watches it and agrees collectives (``coordinator``); ``transport`` holds
the sockets and the address book, ``liveness`` names a peer whose
connections close, ``security`` adds CurveZMQ, and ``stop`` ends a role
that is told to stop.
"""
