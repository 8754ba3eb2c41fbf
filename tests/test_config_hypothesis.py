"""Random flags and values: the parser either accepts them or fails with ConfigError (exit 2)
naming a flag — never another exception."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.config import ConfigError, parse_config
from relax.config.parser import actions_by_dest, build_parser

PARSER, _ = build_parser(False, False)
ACTIONS = [a for a in actions_by_dest(PARSER).values() if a.dest not in ("custom_config_path", "help")]
FLAG_NAMES = sorted(o for a in ACTIONS for o in a.option_strings)

values = st.one_of(
    st.integers(-5, 100).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["true", "false", "{}", "{bad", '{"actor": [1, 2]}', "[1]", "none", "", "-1", "0", "auto",
                     "grpo", "k3", "relax.nope.fn", "512MB"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.{}[]:,", max_size=12),
)
flag_with_values = st.tuples(st.sampled_from(FLAG_NAMES), st.lists(values, max_size=2))
misspelt = st.sampled_from(FLAG_NAMES).map(lambda f: f[:-1] + ("x" if f[-1] != "x" else "y"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(flag_with_values, misspelt.map(lambda f: (f, []))), max_size=5))
def test_random_flags_fail_cleanly(items):
    argv = ["--output-dir", "/tmp/relax-hypothesis"]
    for name, vals in items:
        argv.append(name)
        argv.extend(vals)
    try:
        cfg = parse_config(argv, use_megatron_parser=False)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip()
        assert "--" in message or "argument" in message or "value" in message, message
    else:
        assert cfg.rollout_temperature > 0 and 0 < cfg.rollout_top_p <= 1
