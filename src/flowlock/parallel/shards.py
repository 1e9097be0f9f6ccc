"""Which rows of a length-``S`` sequence each of ``N`` ranks owns.

The split is ``torch.tensor_split``'s (the convention of diffusers' "Ulysses Anything" sharder):
contiguous blocks in rank order, the first ``S % N`` ranks one row longer. ``S < N`` leaves the last
ranks with zero rows, which is a valid shard: those ranks still take part in every collective.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowShards:
    """Row ownership of one sequence: ``seq_len`` rows over ``degree`` ranks; ``rank`` is this one."""

    seq_len: int
    degree: int
    rank: int

    def __post_init__(self):
        if self.degree < 1 or not 0 <= self.rank < self.degree:
            raise ValueError(f"rank {self.rank} is not in a group of {self.degree}")
        if self.seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {self.seq_len}")

    @property
    def sizes(self) -> list[int]:
        """Rows owned by each rank, in rank order; they sum to ``seq_len``."""
        base, extra = divmod(self.seq_len, self.degree)
        return [base + (r < extra) for r in range(self.degree)]

    @property
    def padded(self) -> int:
        """``ceil(S / N)``: every rank's block is padded to this many rows for equal-size collectives."""
        return -(-self.seq_len // self.degree)

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s rows (default: this rank)."""
        rank = self.rank if rank is None else rank
        sizes = self.sizes
        start = sum(sizes[:rank])
        return start, start + sizes[rank]
