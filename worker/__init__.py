"""The worker role's jobs: the training job that bpslaunch starts, and the cluster self-check."""
