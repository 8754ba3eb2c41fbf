"""Router flags (SlimeRouter variant); --sglang-router-* flags are handled with SGLang's."""


def add_flags(parser):
    g = parser.add_argument_group("Router")
    g.add_argument("--use-slime-router", action="store_true", default=False,
                   help="Route by text with SlimeRouter instead of sglang-router's token routing.")
    g.add_argument("--slime-router-middleware-paths", type=str, nargs="+", default="",
                   help="Dotted paths of SlimeRouter middlewares.")
    g.add_argument("--slime-router-timeout", type=float, default=None, help="SlimeRouter request timeout in seconds.")
    g.add_argument("--slime-router-max-connections", type=int, default=None, help="SlimeRouter connection pool size.")
    g.add_argument("--slime-router-health-check-failure-threshold", type=int, default=3,
                   help="Consecutive failures before SlimeRouter marks a worker unhealthy.")
