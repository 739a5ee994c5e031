"""Checks on the folders a run will write, made before any work starts (the CLI runs them before torchrun).

    check_output_dir(args.out, "--out")                     # ConfigError naming the flag, or None
    check_output_dir(cfg.data.cache_dir, "--data.cache_dir")

A folder that does not exist yet is fine when it can be created: its nearest existing ancestor must be
a directory in which a file can really be created (a trial temporary file, so that read-only file
systems are caught even for root, whom permission bits do not stop). Nothing is left behind.
"""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

from fourfold.errors import ConfigError


def check_output_dir(path: str | Path, flag: str) -> None:
    """Raise ConfigError unless `path` is, or can be created as, a directory this process can write into."""
    try:
        p = Path(path)
        if p.is_symlink() and not p.exists():
            raise ConfigError(f"{flag} '{p}' is a symbolic link to nothing; remove the link or give another "
                              "directory.")
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{flag} '{p}' is a file, not a directory; give a directory path (it is created if "
                              "missing), or move the file away.")
        ancestor = p
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise ConfigError(f"{flag} '{p}' lies under '{ancestor}', which is a file, so the directory cannot be "
                              f"created; give a path whose parents are directories.")
    except ValueError as e:  # e.g. a NUL byte in the path
        raise ConfigError(f"{flag} '{path}' is not a usable path ({e}); give a directory path.") from None
    try:
        with tempfile.TemporaryFile(dir=ancestor, prefix=".fourfold-write-check-"):
            pass
    except OSError as e:
        reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
        raise ConfigError(f"{flag} '{p}' is not writable: no file can be created in '{ancestor}' ({reason}). "
                          f"Give {flag} a directory you can write to.") from None
