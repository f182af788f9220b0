"""Alias assignment (pure) and the ``aliases:`` block's validation."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.aliases import Alias, AliasConfig, AliasTarget, caller_key, hash_point
from gateway.config.schema import ConfigError, parse_config

CANARY = Alias("chat", "user", ("llama-8b", "llama-8b-v2"), (90, 10))


def assign(alias: Alias, user: str) -> str:
    return alias.pick(hash_point(alias.name, caller_key(alias.sticky, user, None, "10.0.0.1")))


def test_a_90_10_split_over_2000_users_lands_within_2_percent_and_every_user_stays_on_one_arm():
    users = [f"user-{i}" for i in range(2000)]
    first = {u: assign(CANARY, u) for u in users}
    share = Counter(first.values())["llama-8b-v2"] / len(users)
    assert abs(share - 0.10) <= 0.02, share
    for _ in range(3):      # asked again, in any order: the same arm
        assert all(assign(CANARY, u) == first[u] for u in reversed(users))


def test_growing_the_canary_only_moves_users_onto_it():
    users = [f"user-{i}" for i in range(2000)]
    before = {u: assign(CANARY, u) for u in users}
    grown = Alias("chat", "user", CANARY.models, (80, 20))
    after = {u: assign(grown, u) for u in users}
    assert all(after[u] == "llama-8b-v2" for u in users if before[u] == "llama-8b-v2")
    assert abs(sum(a == "llama-8b-v2" for a in after.values()) / len(users) - 0.20) <= 0.02


def test_two_aliases_split_independently():
    other = Alias("code", "user", ("a", "b"), (90, 10))
    canary_users = {f"u{i}" for i in range(2000) if assign(CANARY, f"u{i}") == "llama-8b-v2"}
    both = sum(assign(other, u) == "b" for u in canary_users)
    assert both < len(canary_users) / 2        # not the same 10% of users on every canary


def test_a_target_with_no_ready_endpoint_is_passed_over():
    a = Alias("chat", "user", ("x", "y", "z"), (1, 1, 1))
    assert a.pick(0.1) == "x"
    assert a.pick(0.1, [False, True, True]) == "y"
    assert a.pick(0.9, [True, True, False]) == "y"
    assert a.pick(0.5, [False, False, False]) == "x"      # none usable: the first (its error says why)


@given(weights=st.lists(st.integers(0, 1000), min_size=1, max_size=6).filter(any),
       u=st.floats(0, 1, exclude_max=True))
def test_the_pick_is_always_a_target_with_weight(weights, u):
    a = Alias("a", "user", tuple(f"m{i}" for i in range(len(weights))), tuple(weights))
    assert weights[a.models.index(a.pick(u))] > 0


def test_the_caller_key_by_stickiness():
    assert caller_key("user", "alice", "s1", "10.0.0.1") == "u:alice"
    assert caller_key("user", None, "s1", "10.0.0.1") == "a:10.0.0.1"
    assert caller_key("session", "alice", "s1", "10.0.0.1") == "s:s1"
    assert caller_key("session", "alice", None, "10.0.0.1") == "u:alice"   # no session: as user
    assert caller_key("none", "alice", "s1", "10.0.0.1") is None


def test_hash_points_are_fixed_values():
    """Stable across processes, replicas and releases: a change here moves every sticky caller."""
    assert hash_point("chat", "u:alice") == pytest.approx(0.8292774891976478, abs=1e-15)
    assert hash_point("chat", "u:bob") == pytest.approx(0.6520781884811987, abs=1e-15)


BASE = """
models:
  - {name: llama-8b, endpoints: [http://127.0.0.1:1]}
  - {name: llama-8b-v2, endpoints: [http://127.0.0.1:2]}
"""


def test_the_block_as_the_issue_writes_it():
    cfg = parse_config(BASE + """
aliases:
  - name: chat
    targets:
      - {model: llama-8b, weight: 90}
      - {model: llama-8b-v2, weight: 10}
    sticky: user
  - name: plain
    targets: [{model: llama-8b}]
""")
    assert cfg.aliases == (AliasConfig(name="chat", targets=(AliasTarget(model="llama-8b", weight=90),
                                                             AliasTarget(model="llama-8b-v2", weight=10))),
                           AliasConfig(name="plain", targets=(AliasTarget(model="llama-8b", weight=1),)))


@pytest.mark.parametrize(("aliases", "path", "words"), [
    ("[{name: llama-8b, targets: [{model: llama-8b-v2}]}]", "aliases[0].name", "shadow a model"),
    ("[{name: c, targets: [{model: llama-8b}]}, {name: d, targets: [{model: c}]}]",
     "aliases[1].targets[0].model", "is an alias"),
    ("[{name: c, targets: [{model: llama-8b}, {model: nope}]}]", "aliases[0].targets[1].model", "unknown model"),
    ("[{name: c, targets: [{model: llama-8b, weight: 0}]}]", "aliases[0].targets", "greater than 0"),
    ("[{name: c, targets: [{model: llama-8b, weight: 0.5}]}]", "aliases[0].targets[0].weight", "int"),
    ("[{name: c, targets: [{model: llama-8b, weight: -1}]}]", "aliases[0].targets[0].weight", ">= 0"),
    ("[{name: c, targets: [{model: llama-8b}, {model: llama-8b}]}]", "aliases[0].targets[1].model", "twice"),
    ("[{name: c, targets: []}]", "aliases[0].targets", "length >= 1"),
    ("[{name: c, targets: [{model: llama-8b}], sticky: forever}]", "aliases[0].sticky", "user, session, none"),
    ("[{name: c, targets: [{model: llama-8b}]}, {name: c, targets: [{model: llama-8b}]}]",
     "aliases[1].name", "duplicate"),
    ("[{name: c, target: [{model: llama-8b}]}]", "aliases[0].target", "unknown key"),
])
def test_invalid_aliases_are_refused_with_their_key_path(aliases, path, words):
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + "aliases: " + aliases, source="gw.yaml")
    assert e.value.key_path == path
    assert words in str(e.value) and str(e.value).startswith(f"gw.yaml: {path}: ")


def test_an_alias_may_not_have_the_name_of_an_adapter_the_config_lists():
    """The alias would take the adapter's requests before the LoRA stage sees them: its targets
    would answer them without the adapter."""
    base = BASE.replace("endpoints: [http://127.0.0.1:2]", "endpoints: [http://127.0.0.1:2], adapters: {sql: org/sql}")
    with pytest.raises(ConfigError) as e:
        parse_config(base + "aliases: [{name: sql, targets: [{model: llama-8b}]}]", source="gw.yaml")
    assert e.value.key_path == "aliases[0].name"
    assert str(e.value) == ("gw.yaml: aliases[0].name: 'sql' is a LoRA adapter of model 'llama-8b-v2' "
                            "(models[1].adapters); an alias may not shadow an adapter")


@pytest.mark.parametrize(("text", "path"), [
    ("aliases: &x [*x]", "aliases[0]"),
    ("aliases: [{name: c, targets: &t [{model: llama-8b, more: *t}]}]", "aliases[0].targets[0].more"),
    ("x: &r {y: [{z: *r}]}", "x.y[0].z"),
])
def test_yaml_that_contains_itself_is_refused_with_the_key_path_where_it_begins(text, path):
    """An anchor used inside its own node loads as a structure without end."""
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + text, source="gw.yaml")
    assert e.value.key_path == path and "contains itself" in str(e.value)


def test_yaml_anchors_used_again_elsewhere_are_fine():
    cfg = parse_config(BASE + "aliases: [{name: a, targets: &t [{model: llama-8b}]}, {name: b, targets: *t}]")
    assert cfg.aliases[0].targets == cfg.aliases[1].targets


def test_with_kubernetes_discovery_a_target_may_be_a_discovered_model():
    cfg = parse_config("kubernetes: {enabled: true}\naliases: [{name: c, targets: [{model: found-by-label}]}]")
    assert cfg.aliases[0].targets[0].model == "found-by-label"


@pytest.mark.parametrize("kubernetes", [False, True])
def test_a_target_that_is_an_adapter_the_config_lists_is_refused_as_one(kubernetes):
    """An alias's targets are models: a listed adapter is named as one (not an unknown model), and
    refused with Kubernetes discovery on too, where a target no model names is otherwise taken for
    a discovered model's (an adapter never has ready endpoints of its own, so a split between it and
    a model sent it nothing)."""
    base = BASE.replace("endpoints: [http://127.0.0.1:2]", "endpoints: [http://127.0.0.1:2], adapters: {sql: org/sql}")
    if kubernetes:
        base = "kubernetes: {enabled: true}\n" + base
    with pytest.raises(ConfigError) as e:
        parse_config(base + "aliases: [{name: c, targets: [{model: llama-8b}, {model: sql}]}]", source="gw.yaml")
    assert e.value.key_path == "aliases[0].targets[1].model"
    assert str(e.value) == ("gw.yaml: aliases[0].targets[1].model: 'sql' is a LoRA adapter of model 'llama-8b-v2' "
                            "(models[1].adapters); an alias's targets are models")
