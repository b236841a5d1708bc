"""Open files: what a command holds at once, checked against the process limit before the work.

A checkpoint of many shards is read with one descriptor per weight file (positional reads from
several threads), and convert writes each output shard through two (buffered and ``O_DIRECT``).
1 121 shards need about 3 400 descriptors; under ``ulimit -n 1024`` the first ``open`` past the
limit raised ``OSError: Too many open files`` deep inside a worker. :func:`reserve` raises the
soft limit towards the hard one when that is enough (what the system allows anyway), and
otherwise refuses before any work, saying how many are needed and how to raise the limit.
"""

from __future__ import annotations

import resource

from fp8export.errors import Fp8ExportError

# Descriptors the interpreter, its libraries, pipes and the files read besides weights use.
BASE = 128


def reserve(needed: int, what: str) -> None:
    """Make sure ``needed`` more descriptors (plus :data:`BASE`) can be open at once, raising the
    soft ``RLIMIT_NOFILE`` up to the hard limit if necessary; else raise Fp8ExportError naming
    ``what`` needs them."""
    total = needed + BASE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or total <= soft:
        return
    if hard == resource.RLIM_INFINITY or total <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (total if hard != resource.RLIM_INFINITY
                                                        else max(total, soft), hard))
            return
        except (ValueError, OSError):
            pass
    raise Fp8ExportError(
        f"{what} needs about {total} files open at once, but this process may open {soft} "
        f"(hard limit {hard}; `ulimit -n`). Raise the limit (e.g. `ulimit -n {total * 2}`) or "
        "merge the shards into fewer files.")
