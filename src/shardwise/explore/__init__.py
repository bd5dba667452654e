"""``shardwise explore``: a real sharded training run that a browser drives.

A server process (server.py) owns N rank processes (rank.py, through job.py) and speaks to
every open page over a WebSocket. The ranks run the same shardwise runtime as any training
job, on a small model of several units learning a synthetic 2-D task (task.py), and publish
the tracer's events as they happen; Reset, Train, Pause and Step are commands the ranks obey
between events. The page draws only what came from a rank.
"""
