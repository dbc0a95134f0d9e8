"""The TrainingJob manifest: its model, fields, checks, safe YAML reading, the CRD, token files.

May import: the names in the registries of meshjob.resharding and meshjob.schedule, and the layers
below them. The layers: docs/architecture.md.
"""
