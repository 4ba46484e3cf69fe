"""The target's features of a request's verified positions, on their way from the verifier to
a drafter pool's eagle drafter (`[router] eagle_placement = "pool"`).

The verifier answers them with each verdict (VerifyResponse.features: the root's and the
accepted nodes' positions) and with a prefill (every prompt position), float16 bytes as
they came (protos.convert.features_to_pb). The router keeps every position's from 0, so
that a pool that lost the request (state_lost: restarted, or another pool after a
failover) is prefilled and sent all of them again, and hands each pool the rows it has
not had yet. Bytes only: nothing here is decoded."""

from __future__ import annotations


class FeatureLog:
    """Rows of float16 features of positions 0..count-1 (bytes, row-major)."""

    def __init__(self):
        self.rows = bytearray()
        self.count = 0  # positions held
        self.row_bytes = 0  # bytes a position (known once some came)

    def add(self, msg) -> None:
        """The features a verifier answer carries (none: nothing). Positions from
        features_start on replace what was held there (a prefill again starts at 0)."""
        count = msg.features_count
        if not count:
            return
        start, data = msg.features_start, msg.features
        if start > self.count:  # a gap: nothing after it could be used; the next prefill starts over
            return
        self.row_bytes = len(data) // count
        del self.rows[start * self.row_bytes:]
        self.rows += data
        self.count = start + count

    def since(self, fed: int) -> tuple[int, int, bytes]:
        """(start, count, bytes) of the positions from `fed` on."""
        fed = min(fed, self.count)
        return fed, self.count - fed, bytes(self.rows[fed * self.row_bytes:])
