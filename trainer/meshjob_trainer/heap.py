"""Keep a rank's freed tensor memory for its next step instead of handing it back to the kernel.

A rank allocates the same large tensors every step: the buffers its transfers receive into (allocated by
its communication engine's thread), gradients, the outputs of a resharding. With glibc's defaults, the
pages of many of them went back to the kernel when freed and were faulted in again on the next step:
- a block of 128 KiB or more is mmapped and unmapped each time (the threshold rises only to the largest
  block freed so far);
- the main heap's top is trimmed once more than twice that threshold is free;
- a thread's arena unmaps a heap (64 MiB) as soon as it is empty, whatever the trim threshold, unless
  the top pad asks for more room than that.
A fault is a page of 4 KiB, 4,096 per 16 MiB, 1-2 µs of CPU each on these machines, taken inside the
transfers (gloo's threads writing a payload into a new buffer): in the resharding benchmark, 4,000-40,000
per repetition of a one-to-many transfer, on the shared cores, on some repetitions and not others.

keep_freed_memory() pins the three: blocks up to 32 MiB (the ceiling of glibc's own threshold on 64-bit)
come from the heaps, a heap keeps up to 1 GiB free at its top, and the top pad (64 MiB) keeps a thread's
empty heaps. After a few steps a rank then reuses its pages; its memory stays at its peak step's, as
PyTorch's caching allocator does on a GPU. Larger blocks are still mapped and unmapped each time. A C
library without glibc's mallopt (musl, macOS): nothing changes.

What a rank keeps is its peak step's memory in each arena, and it is kept for the pages of the next step
of the same shapes. A process that moves on to other shapes (bench resharding's gang runs case after
case: 27 ranks grew by about 1 GB every 15 s, past this machine's 24 GiB within one full run, which then
thrashed) hands it back first: release_freed_memory()."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024  # a thread arena's heap: an empty one is kept only below this


def keep_freed_memory() -> bool:
    """Set this process's allocator to keep what it frees (above). Idempotent; a rank calls it once its
    process starts, before its threads allocate. False where the C library has no mallopt (not glibc) or
    refused a value."""
    mallopt = _libc_function("mallopt")
    return bool(
        mallopt is not None
        and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
        and mallopt(M_TOP_PAD, TOP_PAD_BYTES) == 1
    )


def release_freed_memory() -> bool:
    """Hand back to the kernel what this process's arenas keep free (glibc malloc_trim(0): every
    arena, not only the main heap's top). For a rank done with one set of shapes before the next;
    False where the C library has no malloc_trim or released nothing."""
    trim = _libc_function("malloc_trim")
    return bool(trim is not None and trim(0) == 1)


@functools.cache  # find_library runs ldconfig in a subprocess; bench resharding's ranks release after every case
def _libc_function(name: str) -> Callable[..., Any] | None:
    """The C library's function `name`, or None where there is no such library or function."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None
