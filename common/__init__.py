"""What the commands, the trainer, inference and the evals share: the model a config describes on a mesh, progress lines."""
