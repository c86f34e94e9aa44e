"""What runs a peer: the composition root and the loops around it.

- ``node``: ``Peer``, which builds every collaborator (server, membership, algorithm,
  metrics) from the config and serves the gRPC handler interface.
- ``optimizer``: ``GossipOptimizer``, a user's training loop around a ``Peer``.
- ``site``: ``SiteOptimizer``, one torchrun job as one peer (dense all-reduce inside).
- ``daemon``: ``Daemon``, the task-mode loop of ``gossipgrad-peer``.
- ``checkpoint``: atomic checkpoint files.

Nothing here is imported by the experiment package: it starts peers as processes and reads
their records (``gossipgrad.peer.records``). This ``__init__`` imports nothing, so loading
one module does not load the others.
"""
