"""Option text parsing shared by the server's rules, codecs and the gossip peers' rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from murmura.gossip.mixing import parse_options as gossip_parse_options
from murmura.protocols.options import parse_option, parse_options
from murmura.server.config import ServerConfig


def test_numbers_none_and_text() -> None:
    assert parse_option("2") == 2 and isinstance(parse_option("2"), int)
    assert parse_option(" 0.25 ") == 0.25
    assert parse_option("NONE") is None and parse_option("none") is None
    assert parse_option("geometric") == "geometric"
    assert parse_options({"huber-c": "0", "mode": "fast"}) == {"huber_c": 0, "mode": "fast"}


@given(st.dictionaries(st.text(st.characters(min_codepoint=45, max_codepoint=122), min_size=1,
                                max_size=8),
                       st.one_of(st.integers(-10**6, 10**6).map(str),
                                 st.floats(allow_nan=False, allow_infinity=False).map(repr),
                                 st.sampled_from(["none", "None", "fast", "a-b"]))))
def test_the_server_and_the_gossip_peers_read_options_alike(options: dict[str, str]) -> None:
    assert gossip_parse_options(options) == parse_options(options)


def test_the_servers_defense_options_go_through_it() -> None:
    config = ServerConfig.from_flat(defense="krum", defense_options={"f": "2"})
    assert config.policy.defense_kwargs() == {"f": 2}
