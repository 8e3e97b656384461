"""The one exception a user of ``bitmtp-export`` sees: which file, what was wrong, what to do."""

from __future__ import annotations

import os


class ExportError(Exception):
    """Bad input to the exporter. ``str(e)`` is ``<file>: <what was wrong>; <what to do>``."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"{self.path}: {problem}; {fix}")
