"""The worker role and the training job that bpslaunch starts (arrives with the runtime)."""
