"""Kubernetes Nodes as placement hosts, and `stages: auto` searched on them (no Kubernetes client).

May import: meshjob.search and the layers below. The layers: docs/architecture.md.
"""
