"""Ray: the cluster (attach or start), the trainer actor group and the engine hosts. The driver holds no GPU."""
