"""Real SGLang: `server.SGLangServerProcess` (launch_server) and `router.RouterProcess` (sglang-router)."""

__all__ = ["RouterProcess", "SGLangServerProcess"]


def __getattr__(name):
    if name == "RouterProcess":
        from relax.backends.sglang.router import RouterProcess

        return RouterProcess
    if name == "SGLangServerProcess":
        from relax.backends.sglang.server import SGLangServerProcess

        return SGLangServerProcess
    raise AttributeError(name)
