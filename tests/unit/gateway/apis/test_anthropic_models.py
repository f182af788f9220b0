"""Anthropic's Models API pages of the OpenAI listing (gateway/apis/anthropic_models.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from multidict import MultiDict

from gateway.apis.anthropic_models import MAX_LIMIT, model_info, models_page
from gateway.errors import GatewayError

_ids = st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=30)


def _entries(ids: list[str]) -> list[dict]:
    return [{"id": i, "object": "model", "created": 1_767_225_600, "owned_by": "switchyard"} for i in ids]


def _page(entries: list[dict], **query: object) -> dict:
    return models_page(entries, MultiDict({k: str(v) for k, v in query.items()}))


def test_a_model_info_has_anthropics_fields_only():
    assert model_info(_entries(["org/m"])[0]) == {"type": "model", "id": "org/m", "display_name": "org/m",
                                                  "created_at": "2026-01-01T00:00:00Z"}


@given(_ids, st.integers(1, MAX_LIMIT))
def test_walking_forward_or_backward_meets_every_model_once(ids, limit):
    entries = _entries(ids)
    page, walked = _page(entries, limit=limit), []
    while True:
        walked += [m["id"] for m in page["data"]]
        assert len(page["data"]) <= limit
        if not page["has_more"]:
            break
        page = _page(entries, limit=limit, after_id=page["last_id"])
    assert walked == ids
    if not ids:
        return
    page, back = _page(entries, limit=limit, before_id=ids[-1]), []
    while True:
        back = [m["id"] for m in page["data"]] + back
        if not page["has_more"]:
            break
        page = _page(entries, limit=limit, before_id=page["first_id"])
    assert back == ids[:-1]


@given(st.lists(st.tuples(st.sampled_from(["limit", "after_id", "before_id", "other"]), st.text(max_size=12)),
                max_size=4))
def test_any_query_is_a_page_or_a_400(pairs):
    try:
        page = models_page(_entries(["a", "b", "c"]), MultiDict(pairs))
    except GatewayError as e:
        assert e.status == 400 and e.param in ("limit", "after_id", "before_id") and e.message
    else:
        assert set(page) == {"data", "first_id", "last_id", "has_more"}


def test_limits_and_cursors_that_are_refused():
    entries = _entries(["a", "b"])
    for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "+5"}, {"limit": " 5"}, {"limit": "1_0"},
                  {"limit": "٥"}, {"limit": "9" * 5000}, {"after_id": "z"}, {"before_id": ""},
                  {"after_id": "a", "before_id": "b"}):
        try:
            _page(entries, **query)
        except GatewayError as e:
            assert e.status == 400 and len(e.message) < 200, e.message
        else:
            raise AssertionError(query)
    assert _page(entries, limit="0001")["data"][0]["id"] == "a"
