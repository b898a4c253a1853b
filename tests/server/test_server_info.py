"""`GET /server_info`: the one field of SGLang's route of that name that sglang-router reads
when it registers a replica (nanoserve/live_fleet.py; tests/server/test_fleet.py runs the
router)."""

from __future__ import annotations

from support.http_harness import serving
from support.server_harness import assert_error, make_app, make_engine

from nanoserve.bridge.clock import StepClock
from nanoserve.server import ServerConfig, counter_ids, create_app


async def test_server_info_names_the_served_model() -> None:
    # The router files the replica under this name and lists it in its own /v1/models.
    app = create_app(make_engine(), ServerConfig("smol-replica"), clock=StepClock(),
                     id_source=counter_ids())
    async with serving(app) as h:
        r = await h.request("GET", "/server_info")
        assert r.status == 200, r.body
        assert r.json() == {"served_model_name": "smol-replica"}


async def test_server_info_needs_the_api_key_like_every_route_but_health() -> None:
    async with serving(make_app(api_key="sk-key")) as h:
        err = assert_error(await h.request("GET", "/server_info"), 401, None)
        assert err["code"] == "invalid_api_key"
        ok = await h.request("GET", "/server_info", headers={"authorization": "Bearer sk-key"})
        assert ok.json() == {"served_model_name": "stub"}
