"""Errors of flowlock's parallel layer."""


class CollectiveError(RuntimeError):
    """A collective flowlock issued failed: a peer died, timed out, or disagreed on the contract.

    Raised on every surviving rank instead of a hang; the message names the collective, the rank and
    the group size, and chains the backend's own error.
    """
