"""Old home of the planner, observer and benchmark harness (before 0.2).

``shardwise.tools.<name>`` still imports, with a DeprecationWarning, until 0.3 (shardwise.moved
maps each old name to its new home): use ``shardwise.planner``, ``shardwise.observer`` or
``shardwise.bench``.
"""
