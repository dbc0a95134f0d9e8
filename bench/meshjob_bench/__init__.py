"""Benchmarks: the paper's experiments on this machine, reported as ratios (table, JSON, PNG).

One module per benchmark, each with add_arguments(parser) and main(args) -> int; `meshjob bench NAME`
runs them (cli.py).
"""
