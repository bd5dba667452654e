"""Exceptions that shardwise raises for misuse and for broken collectives."""


class ShardwiseError(RuntimeError):
    """A misuse of shardwise: the message names the module or parameter and says the fix."""


class CollectiveError(RuntimeError):
    """A collective did not complete: a rank died, failed, or issued a different collective."""
