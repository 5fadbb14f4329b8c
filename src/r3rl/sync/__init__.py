"""Weight sync: the trainer's new weights into every rollout engine after each step.

One protocol driver, ``protocol`` (vLLM's weight-transfer routes on every engine at once), carries the buckets that
``r3rl.train.export`` streams over one of the wires in ``wires`` (trainer side: ``r3rl_gloo`` on CPUs, vLLM's
``nccl`` and ``ipc`` engines on GPUs). The engine side is ``gloo_engine`` (r3rl's transfer engine, a vLLM plugin),
``cpu_experts`` (updates of the CPU profile's prepacked experts) and ``worker_extension`` (the ``--worker-extension-cls``
hook). ``disk`` is the fallback for engines attached by URL: an HF folder reloaded by each engine.

Submodules are imported on use: the vLLM worker imports ``worker_extension`` and ``gloo_engine`` and must not load
the trainer's side.
"""
