"""``gossipgrad-experiment``: scripted multi-site experiments from one TOML spec.

A spec (``gossipgrad.experiment.spec``) names the swarm (peers, task, gossip settings), the
network it runs on (``local`` processes, ``netns`` namespaces with shaped links, or ``ssh``
hosts) and the baselines to run in the same conditions (DDP all-reduce, DDP + PowerSGD). The
runner launches it all, shows one live table, and writes ``report.json``, PNG plots and a
markdown summary (``gossipgrad.experiment.report``). See docs/experiments.md.
"""
