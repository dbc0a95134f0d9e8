"""The meshjob Kubernetes operator (kopf): TrainingJob -> topology-placed trainer pods.

Importing this package registers the kopf handlers, so `kopf run -m meshjob.operator` works;
`meshjob operator` is the same with meshjob's own flags (see cli.py).
"""
if __name__ == "operator":
    # Imported as the top-level `operator`: the repository root is on sys.path (`python -m ...` or
    # `python -c` run from a checkout) and this folder shadows the standard library's `operator`,
    # which `collections` needs while the interpreter starts. Become the real module instead of
    # failing: run the standard library's source in this module's namespace (only os and builtins
    # are safe to use this early).
    import os as _os

    _path = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_path, encoding="utf-8") as _source:
        exec(compile(_source.read(), _path, "exec"), globals())
    __file__ = _path
else:
    from meshjob.operator import handlers  # noqa: F401  (registers the handlers with kopf)
