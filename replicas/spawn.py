"""Start ``spawn`` child processes whose targets live in this package, without re-running the
caller's ``__main__``.

A ``spawn`` child imports the parent's main module before it runs its target. A script without an
``if __name__ == "__main__":`` guard (the README's engine snippet, pasted into a file) then builds
a second engine in the child, which fails its bootstrap ("An attempt has been made to start a new
process before the current process has finished its bootstrapping phase"), and the parent stayed
blocked for good in ``Process.start``. Our targets (the grammar compiler, tensor-parallel ranks)
need only this package, so the main module is hidden from the child while it starts.
"""

from __future__ import annotations

import sys

_MISSING = object()


def start_without_main(proc) -> None:
    """``proc.start()`` for a ``multiprocessing`` spawn ``Process`` whose target and arguments can be
    pickled without the main module: the child does not import ``__main__``."""
    main = sys.modules.get("__main__")
    if main is None:
        proc.start()
        return
    saved = {k: main.__dict__.get(k, _MISSING) for k in ("__file__", "__spec__")}
    try:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None       # spawn re-imports the main module from its spec name or its path
        proc.start()
    finally:
        for key, value in saved.items():
            if value is _MISSING:
                main.__dict__.pop(key, None)
            else:
                main.__dict__[key] = value
