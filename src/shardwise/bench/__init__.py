"""The benchmark harness behind ``shardwise bench``: shardwise against FSDP2, DDP and the
compute floor (`harness`), the counted visit (`counts`), the optimizers each system steps
(`optimizers`), the machine's load (`machine`) and two nodes on one machine (`netns`)."""
