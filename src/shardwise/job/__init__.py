"""The built-in job: ``shardwise train`` (train.py), its GPT (models/) and its offline corpus
(data.py). It uses the public face and the core; nothing in the core imports it."""
