"""The peer daemon: config, transport, membership, topology, gossip, training, metrics."""
