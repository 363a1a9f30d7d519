import urllib.request

from kvpool.shared.metrics import Histogram, MetricsServer, family, histogram_family, parse_text


def test_text_format_and_parse_roundtrip():
    text = family("kvpool_blocks_free", "gauge", "Free blocks.", [({"pool": "a"}, 7), ({"pool": 'b"x'}, 3)])
    h = Histogram([0.001, 0.01])
    for v in (0.0005, 0.002, 0.5):
        h.observe(v)
    text += histogram_family("kvpool_step_seconds", "Step latency.", [({}, h)])
    assert "# TYPE kvpool_blocks_free gauge" in text
    assert 'kvpool_blocks_free{pool="b\\"x"} 3' in text
    m = parse_text(text)
    assert m[("kvpool_blocks_free", (("pool", "a"),))] == 7
    assert m[("kvpool_step_seconds_bucket", (("le", "0.001"),))] == 1
    assert m[("kvpool_step_seconds_bucket", (("le", "0.01"),))] == 2
    assert m[("kvpool_step_seconds_bucket", (("le", "+Inf"),))] == 3
    assert m[("kvpool_step_seconds_count", ())] == 3


def test_http_endpoint_serves_latest_snapshot():
    srv = MetricsServer("127.0.0.1", 0)
    try:
        srv.update(family("up", "gauge", "Up.", [({}, 1)]))
        url = f"http://127.0.0.1:{srv.port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert parse_text(body)[("up", ())] == 1
        srv.update(family("up", "gauge", "Up.", [({}, 0)]))
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert parse_text(body)[("up", ())] == 0
    finally:
        srv.close()
