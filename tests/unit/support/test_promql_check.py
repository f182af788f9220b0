"""The dashboard/alert checker (tests/support/promql_check.py) catches what would show "No data"."""

from __future__ import annotations

import pytest

from tests.support.promql_check import Query, check, exported, parse, uses, variable_query

SCRAPE = exported("""\
# HELP switchyard_requests_total Client requests
# TYPE switchyard_requests_total counter
switchyard_requests_total{model="m",status="200",strategy="random"} 3.0
# HELP switchyard_ttft_seconds TTFT
# TYPE switchyard_ttft_seconds histogram
switchyard_ttft_seconds_bucket{le="0.1",model="m"} 1.0
switchyard_ttft_seconds_bucket{le="+Inf",model="m"} 1.0
switchyard_ttft_seconds_count{model="m"} 1.0
switchyard_ttft_seconds_sum{model="m"} 0.05
# HELP switchyard_endpoint_info Endpoints
# TYPE switchyard_endpoint_info gauge
switchyard_endpoint_info{endpoint="a:1",model="m",role="decode"} 1.0
# HELP switchyard_pending Pending
# TYPE switchyard_pending gauge
switchyard_pending{endpoint="a:1",model="m"} 0.0
""")


def problems(expr: str, legend: str = "") -> list[str]:
    return check([Query("q", expr, legend)], SCRAPE)


def test_what_the_gateway_exports_passes():
    assert SCRAPE["switchyard_requests_total"] == {"model", "status", "strategy"}
    assert problems('sum by (model, status) (rate(switchyard_requests_total{job=~"$job", model=~"$model"}'
                    '[$__rate_interval]))', "{{model}} {{status}}") == []
    assert problems("rate(switchyard_requests_total[5m])", "{{instance}} {{strategy}}") == []   # target labels
    assert problems('histogram_quantile(0.99, sum by (model, le) (rate(switchyard_ttft_seconds_bucket'
                    '{model=~"$model"}[$__rate_interval] offset 1h)))') == []
    assert problems('sum by (model, endpoint) (switchyard_pending) and on (model, endpoint) '
                    'switchyard_endpoint_info{role!="aggregated"}') == []
    assert problems('(sum(rate(switchyard_requests_total{status=~"5.."}[5m])) or vector(0)) / '
                    'sum(rate(switchyard_requests_total[5m]))') == []


@pytest.mark.parametrize("expr, legend, says", [
    ("rate(switchyard_request_total[5m])", "", "switchyard_request_total is not exported"),      # renamed
    ("rate(switchyard_requests[5m])", "", "switchyard_requests is not exported"),                # no _total
    ("rate(switchyard_requests_total_bucket[5m])", "", "is not exported"),                       # a counter
    ("rate(switchyard_ttft_seconds[5m])", "", "switchyard_ttft_seconds is not exported"),        # no suffix
    ('rate(switchyard_requests_total{modle="m"}[5m])', "", "has no label modle"),                # matcher
    ("sum by (endpoint) (rate(switchyard_requests_total[5m]))", "", "uses endpoint"),            # by clause
    ("sum(rate(switchyard_requests_total[5m]))", "{{model}}", "legend {{model}}"),               # legend
    ("sum by (model) (sum by (status) (rate(switchyard_requests_total[5m])))", "", "uses model"),  # nested
    ("histogram_quantile(0.9, sum by (model) (rate(switchyard_ttft_seconds_bucket[5m])))", "", "uses le"),
    ("sum by (model) (switchyard_pending) * on (model) switchyard_endpoint_info", "{{endpoint}}", "legend"),
    ("switchyard_pending * on (model, endpoint) group_left (roles) switchyard_endpoint_info", "", "uses roles"),
    ('{__name__="switchyard_gone"}', "", "switchyard_gone is not exported"),
    ("rate(switchyard_requests_total)", "", "does not parse"),                                   # type error
    ("sum by (model (x)", "", "does not parse"),
])
def test_what_would_show_no_data_is_reported(expr, legend, says):
    got = problems(expr, legend)
    assert got and any(says in p for p in got), got


def test_label_values_variables_are_checked():
    ok = variable_query("v", 'label_values(switchyard_endpoint_info{job=~"$job"}, model)')
    bad = variable_query("v", "label_values(switchyard_endpoint_info, pod_name)")
    assert check([ok], SCRAPE) == []
    assert "pod_name" in check([bad], SCRAPE)[0]
    with pytest.raises(ValueError):
        variable_query("v", "query_result(up)")


def test_uses_sees_through_functions_offsets_and_subqueries():
    u = uses('max_over_time(rate(a_total{x="1"}[5m] offset 10m)[1h:1m]) unless on (m) b{y!=""} @ 100')
    assert u == {"a_total": {"x"}, "b": {"y"}}
    with pytest.raises(ValueError):
        parse("nosuchfunction(a)")
