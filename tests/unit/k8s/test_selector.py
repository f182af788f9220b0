"""Label selectors: semantics and malformed input."""

from __future__ import annotations

import pytest

from k8s.selector import SelectorError, matches, parse_selector

# -- selectors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("selector,labels,expected", [
    ("model.aibrix.ai/name", {"model.aibrix.ai/name": "m"}, True),
    ("model.aibrix.ai/name", {"app": "x"}, False),
    ("!canary", {"app": "x"}, True),
    ("!canary", {"canary": ""}, False),
    ("app=web", {"app": "web"}, True),
    ("app==web", {"app": "api"}, False),
    ("app!=web", {"app": "api"}, True),
    ("app!=web", {}, True),                       # != matches pods without the key, as in Kubernetes
    ("role-name in (prefill,decode)", {"role-name": "decode"}, True),
    ("role-name in (prefill, decode)", {"role-name": "all"}, False),
    ("role-name notin (prefill,decode)", {}, True),
    ("tier>2", {"tier": "3"}, True),
    ("tier<2", {"tier": "x"}, False),
    ("model.aibrix.ai/name,env in (prod),role-name!=decode", {"model.aibrix.ai/name": "m", "env": "prod",
                                                             "role-name": "prefill"}, True),
    ("model.aibrix.ai/name,env in (prod),role-name!=decode", {"model.aibrix.ai/name": "m", "env": "prod",
                                                             "role-name": "decode"}, False),
    ("", {"anything": "goes"}, True),
    ("app=", {"app": ""}, True),                  # empty values are values
])
def test_label_selector_semantics(selector, labels, expected):
    assert matches(parse_selector(selector), labels) is expected


@pytest.mark.parametrize("bad", ["a in (", "a in ()", "a,,b", "=x", "a in (b", "bad key!", "a) in (b"])
def test_malformed_selectors_are_rejected(bad):
    with pytest.raises(SelectorError):
        parse_selector(bad)
