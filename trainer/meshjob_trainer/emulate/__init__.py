"""A cluster emulated on one machine: network namespaces per host, forked worker ranks.

Imports no torch: the trainer is imported inside the functions that run ranks.
"""
