"""A cluster emulated on one machine: network namespaces per host (netns), and the progress of a
run on it (progress); meshjob_trainer.launch forks the ranks into it.

Imports no torch: the trainer is imported inside the functions that run ranks.
"""
