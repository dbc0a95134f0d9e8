"""What compute costs: per-stage forward and backward times, device profiles and their roofline.

May import: meshjob.spec and the layers below. The layers: docs/architecture.md.
"""
