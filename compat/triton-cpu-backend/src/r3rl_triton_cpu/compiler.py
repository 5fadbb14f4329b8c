from triton.backends.compiler import BaseBackend, GPUTarget


class CPUPlaceholderBackend(BaseBackend):
    """Refuses to compile: under TRITON_INTERPRET=1 Triton never asks a backend to."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "r3rl-cpu-placeholder"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError("the r3rl placeholder Triton backend cannot compile; set TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise RuntimeError("the r3rl placeholder Triton backend cannot compile; set TRITON_INTERPRET=1")

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
