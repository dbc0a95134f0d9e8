"""Benchmarks: the paper's experiments on this machine, reported as ratios (table, JSON, PNG).

One module per benchmark, each with add_arguments(parser) and main(args) -> int:
resharding (seed 000 §5.1), pipeline, planner, operator.
"""
