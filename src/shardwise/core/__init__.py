"""The core: shardwise's mechanism, and nothing that uses it.

Process groups and the mesh (groups), torch.distributed's communication (collectives, flight,
codecs), pure tensor bookkeeping (layout, placement), one unit's life cycle (unit, buckets),
the hooks and their order (runtime, streams, events), building them from a module (build, wrap,
policies) and what wraps modules beside them (recompute, activation_offload, conversions,
optimizer_guard, scaler). It imports no room of the package (docs/architecture.md, "How the
package is cut"); the public face is ``import shardwise``.
"""
