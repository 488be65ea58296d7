"""The worker's side of the parameter server (ps-lite's KVWorker).

``ps_client`` is the caller's API (push_pull, declare, collectives),
``engine`` the background thread that compresses, sends and collects
answers, and ``handle`` the pending result of one push_pull.
"""
