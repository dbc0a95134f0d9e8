"""`meshjob tune`'s search: stage model, memory model, the space and the DP over it.

May import: meshjob.plan and the layers below. The layers: docs/architecture.md.
"""
