"""The worker role's jobs: the training job that bpslaunch starts, and the cluster self-check.

What a worker does on the wire (push/pull of each tensor to the servers) is not here but in
the library: adtopk_ps/client/ (``PSClient``, its ``Handle`` and the engine thread that
compresses, sends and collects answers); adtopk_ps/torch/ builds training on it.
"""
