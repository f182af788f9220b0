"""Keys and users: bearer tokens, generated keys, precedence of store, config and default."""

import hashlib

import pytest

from gateway.config.schema import ApiKey, AuthConfig, LimitsConfig, UserLimits
from gateway.tenants.directory import (
    Directory,
    bearer_token,
    key_digest,
    limits_from_stored,
    limits_stored,
    new_key,
)


@pytest.mark.parametrize("header,token", [("Bearer sk-1", "sk-1"), ("bearer  sk-1 ", "sk-1"), ("BEARER sk-1", "sk-1"),
                                          ("Basic abc", None), ("Bearer", None), ("Bearer ", None), ("", None),
                                          (None, None), ("sk-1", None)])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_generated_keys_are_unique_and_prefixed():
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("sk-sy-") and len(k) > 40 for k in keys)


def test_directory_precedence_store_then_config_then_default():
    auth = AuthConfig(api_keys=(ApiKey(key="k", user="alice", key_sha256=key_digest("k")),))
    d = Directory(auth, LimitsConfig(users={"alice": UserLimits(rpm=1), "free": UserLimits()},
                                     default_user=UserLimits(rpm=7)))
    assert d.key(hashlib.sha256(b"k").hexdigest()).user == "alice"
    assert d.key(key_digest("nope")) is None
    assert d.limits_for("alice").rpm == 1
    assert d.limits_for("stranger").rpm == 7
    assert d.limits_for("free") is None                  # configured with no limits: unlimited
    assert d.limits_for(None) is None
    d.replace_store({"alice": UserLimits(rpm=2)}, {})
    assert d.limits_for("alice").rpm == 2
    assert d.user_view("alice") == {"name": "alice", "rpm": 2, "tpm": 0, "max_concurrent": 0, "models": None,
                                    "priority": None, "source": "store", "overrides_config": True}


def test_a_users_model_list_is_looked_up_as_its_limits_and_kept_in_its_stored_record():
    """``models``: the names a user may ask for, from the record that gives the user's limits
    (store, config, default_user); null is every model. A record stored by an older release,
    without the field, reads as no list."""
    d = Directory(AuthConfig(), LimitsConfig(users={"alice": UserLimits(models=("m", "chat")), "bob": UserLimits(rpm=1)},
                                             default_user=UserLimits(models=("small",))))
    assert d.models_for("alice") == ("m", "chat")
    assert d.models_for("bob") is None
    assert d.models_for("stranger") == ("small",)
    assert d.models_for(None) is None
    assert d.limits_for("alice") is None                 # a list alone limits no rate
    d.replace_store({"alice": UserLimits(rpm=2)}, {})
    assert d.models_for("alice") is None                 # the store's record replaces the config's
    stored = limits_stored(UserLimits(rpm=2, models=("m",)))
    assert stored == {"rpm": 2, "tpm": 0, "max_concurrent": 0, "models": ["m"]}
    assert limits_from_stored(stored) == UserLimits(rpm=2, models=("m",))
    assert limits_from_stored({"rpm": 2, "tpm": 0, "max_concurrent": 0}) == UserLimits(rpm=2)


def test_a_users_class_is_looked_up_as_its_limits_and_kept_in_its_stored_record():
    """``priority``: the admission class from the record that gives the user's limits (a store
    record over the configured one), else the default user's; a record stored without one (an
    older release's, or naming a class this release does not know) has none."""
    d = Directory(AuthConfig(), LimitsConfig(users={"alice": UserLimits(priority="critical"), "bob": UserLimits(rpm=1)},
                                             default_user=UserLimits(priority="sheddable")))
    assert d.priority_for("alice") == "critical"
    assert d.priority_for("bob") == "sheddable"          # no class of its own: the default user's
    assert d.priority_for("stranger") == "sheddable"
    assert d.priority_for(None) == "sheddable"
    d.replace_store({"alice": UserLimits(rpm=2), "bob": UserLimits(priority="standard")}, {})
    assert d.priority_for("alice") == "sheddable"        # the store's record replaces the config's
    assert d.priority_for("bob") == "standard"
    stored = limits_stored(UserLimits(rpm=2, priority="critical"))
    assert stored == {"rpm": 2, "tpm": 0, "max_concurrent": 0, "priority": "critical"}
    assert limits_from_stored(stored) == UserLimits(rpm=2, priority="critical")
    assert limits_from_stored({"rpm": 2, "priority": "urgent"}) == UserLimits(rpm=2)
    assert limits_from_stored({"rpm": 2, "priority": ["critical"]}) == UserLimits(rpm=2)
