"""The server's allow-lists as the user writes them (settings, `moedesk serve` flags), Host headers as clients
send them, and a failure inside the API answered in OpenAI's shape. No model: the real server's behaviour is
in test_serve_hostile.py."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from app.serve import cli
from app.serve.api import create_app
from app.serve.guard import parse_hosts, parse_origins, split_host


def test_origins_are_normalised_and_bad_ones_named():
    assert parse_origins([" HTTP://LocalHost:3000/ ", "chrome-extension://abc", "null", "*", "http://localhost:3000"]) \
        == ("http://localhost:3000", "chrome-extension://abc", "null", "*")
    for bad in ("localhost:3000/app", "example.com", "http://h/path", "http://h?q", "http://u:p@h", "http://h:port",
                "https://"):
        with pytest.raises(ValueError, match=r"allowed origin .*scheme://host\[:port\]"):
            parse_origins([bad])


def test_hosts_are_normalised_and_bad_ones_named():
    assert parse_hosts(["GPU-Box.lan.", "192.168.1.20", "[fe80::1]", "*"]) == ("gpu-box.lan", "192.168.1.20",
                                                                                "fe80::1", "*")
    for bad in ("http://gpu-box", "gpu-box:8000", "a/b", "", "u@h"):
        with pytest.raises(ValueError, match="allowed host"):
            parse_hosts([bad])


@pytest.mark.parametrize("header,parsed", [
    ("LocalHost:8642", ("localhost", 8642)), ("localhost", ("localhost", None)), ("[::1]:80", ("::1", 80)),
    ("[::1]", ("::1", None)), ("h:99999999", ("h", -1)), ("h:x", ("h", -1)), ("[::1]x", ("::1", -1)),
    ("example.com.:1", ("example.com", 1)), ("a:b:c", ("a:b:c", None))])
def test_host_headers_are_split_into_name_and_port(header, parsed):
    assert split_host(header) == parsed


def test_a_bad_allow_list_stops_moedesk_serve_in_one_line(capsys):
    assert cli.main(["--model", "demo", "--allow-origin", "example.com"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("moedesk serve: allowed origin 'example.com'") and "\n" not in err
    assert cli.main(["--model", "demo", "--allow-host", "http://x"]) == 1
    assert capsys.readouterr().err.startswith("moedesk serve: allowed host 'http://x'")


class Broken:
    def served_model(self):
        raise RuntimeError("the backend broke")


def test_a_failure_inside_the_api_is_a_500_in_openais_shape():
    client = TestClient(create_app(Broken()), raise_server_exceptions=False)
    r = client.get("/v1/models", headers={"host": "127.0.0.1"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "the backend broke" not in r.text                   # the detail goes to the log, not to the client
