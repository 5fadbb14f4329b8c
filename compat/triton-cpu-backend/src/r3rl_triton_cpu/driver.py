import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CPUPlaceholderDriver(DriverBase):
    """Reports itself active only when Triton's interpreter is on, so it never shadows a real GPU driver."""

    @staticmethod
    def is_active() -> bool:
        import os

        return os.environ.get("TRITON_INTERPRET") == "1"

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the r3rl placeholder Triton backend has no launcher; set TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the r3rl placeholder Triton backend cannot benchmark")
