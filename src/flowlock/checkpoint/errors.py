"""The one exception the checkpoint package raises for input it cannot map exactly."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(ValueError):
    """A checkpoint, directory or argument that cannot be converted exactly.

    ``problems`` holds one line per finding, each naming the tensors, files or keys involved; the
    message is the summary followed by those lines. Raised before anything is written whenever the
    defect is visible from names, shapes, dtypes or config alone.
    """

    def __init__(self, summary: str, problems: Sequence[str] = ()) -> None:
        self.summary = summary
        self.problems = tuple(problems)
        super().__init__(summary + "".join(f"\n  - {p}" for p in self.problems))
