"""Device meshes and GSPMD sharding specs: which device holds which tile of a tensor.

May import: meshjob.errors. The layers: docs/architecture.md.
"""
