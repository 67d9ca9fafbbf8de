"""Training: the TRL subclass and every TRL touch point, the shared-prefix loss, callbacks, checkpoints, the run dir."""
