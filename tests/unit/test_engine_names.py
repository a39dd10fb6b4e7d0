"""Engines are named in metrics labels by a configured name or by role and order, never by URL (issue 38)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, Settings, build, engine_names
from gateway.engines.pool import EnginePool
from gateway.telemetry import Metrics


def test_configured_names_win_and_the_rest_are_numbered_in_order():
    names = engine_names(Settings(engine_names=["p-east=http://10.0.0.5:8100/"]))
    pool = EnginePool("prefill", ["http://10.0.0.4:8100", "http://10.0.0.5:8100", "http://10.0.0.6:8100"], names)
    assert [e.name for e in pool.engines.values()] == ["prefill-0", "p-east", "prefill-2"]
    pool.remove("http://10.0.0.4:8100")
    assert pool.add("http://10.0.0.7:8100").name == "prefill-3"          # a number is never given twice
    assert pool.add("http://10.0.0.6:8100").name == "prefill-2"          # known: the same engine
    pool.names.update({"http://10.0.0.8:8100": "p-west"})                # a reloaded configuration's names
    assert pool.add("http://10.0.0.8:8100").name == "p-west"


def test_a_url_never_becomes_a_label():
    metrics = Metrics()
    metrics.engine_names["http://10.0.0.4:8100"] = "decode-0"
    metrics.pinned_tokens.labels(metrics.engine_label("http://10.0.0.4:8100")).set(5)
    metrics.pinned_tokens.labels(metrics.engine_label("http://10.9.9.9:1")).set(1)     # not (yet) known
    text = metrics.render().decode()
    assert 'engine="decode-0"' in text and "10.0.0" not in text and "10.9.9.9" not in text


@pytest.mark.parametrize("entry", ["http://10.0.0.5:8100", "has space=http://h:1", "=http://h:1", "name="])
def test_a_malformed_name_is_refused(entry):
    with pytest.raises(ConfigError, match="engine_names"):
        build({"engine_names": [entry]}, environ={})


def test_the_metrics_port_is_a_second_port():
    with pytest.raises(ConfigError, match="metrics_port"):
        build({"port": 8000, "metrics_port": 8000}, environ={})
    assert build({"port": 8000, "metrics_port": 9100}, environ={}).metrics_port == 9100
