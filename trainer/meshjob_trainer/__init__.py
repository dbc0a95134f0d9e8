"""The meshjob trainer: torch.distributed worker ranks that run a meshjob Plan (resharding executor,
models, pipeline executor, checkpoints, metrics), the gang launcher and the emulated cluster."""
