"""The embedded engine: a CPU/small-model inference server that speaks SGLang's native HTTP API.

- `engine.EmbeddedEngine`: the batching scheduler core (no HTTP).
- `server`: the FastAPI app and `python -m relax.backends.embedded.server` entry point.
- `launcher.EmbeddedServerProcess`: run the server as a child process.
- `sampling`: sampling parameters and the log-prob convention.
"""

__all__ = ["EmbeddedEngine", "EngineError", "EmbeddedServerProcess", "SamplingParams"]


def __getattr__(name):  # lazy: importing the package does not import torch/transformers
    if name in ("EmbeddedEngine", "EngineError"):
        from relax.backends.embedded import engine

        return getattr(engine, name)
    if name == "EmbeddedServerProcess":
        from relax.backends.embedded.launcher import EmbeddedServerProcess

        return EmbeddedServerProcess
    if name == "SamplingParams":
        from relax.backends.embedded.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
