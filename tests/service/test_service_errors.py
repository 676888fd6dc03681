"""Bad requests get one clear line, the right 4xx and change nothing: a body that is not JSON (400) or not
sent as JSON (415), names outside their rules (the rule, not a regular expression), a path no route has, a
name still held by a deleted run's files, a count that is not a JSON integer (in the body or the query; 1.0 and
2e0 in the body are), a count out of its range, an override 1.0 for an integer key (as the TOML's), a query
boolean other than true or false, a string with an unpaired surrogate, an override number that is not finite, a
run deleted while a stop or resume of it was under way; and the list filter takes several states."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import HTTPException

from service.operations import Service
from service.settings import Settings

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


def run_dirs(svc) -> set[str]:
    d = svc.state_dir / "runs"
    return {p.name for p in d.iterdir()} if d.exists() else set()


def post_raw(svc, content: bytes, content_type: str | None) -> httpx.Response:
    headers = {**svc.auth, **({"content-type": content_type} if content_type else {})}
    return svc.client.post("/v1/runs", content=content, headers=headers)


def test_a_body_that_is_not_json_is_400_naming_where(fake_service):
    before = run_dirs(fake_service)
    r = post_raw(fake_service, b'{"toml": "x",', "application/json")
    assert r.status_code == 400, r.text
    assert r.json() == {"detail": "request body is not valid JSON: Expecting property name enclosed in double quotes "
                                  "(at character 13)"}
    assert post_raw(fake_service, b"\xff\xfe", "application/json").status_code == 400
    assert run_dirs(fake_service) == before


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_not_sent_as_json_is_415(fake_service, content_type):
    # curl -d '{...}' without -H 'content-type: application/json' sends a form
    r = post_raw(fake_service, b'{"toml": "", "name": "form"}', content_type)
    assert r.status_code == 415, r.text
    assert r.json() == {"detail": f"content-type '{content_type}': the body must be sent as application/json"}
    assert fake_service.client.get("/v1/runs/form").status_code == 404


def test_a_missing_body_says_so(fake_service):
    r = post_raw(fake_service, b"", "application/json")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body"] and error["msg"] == "request body is missing: expected a JSON object"


@pytest.mark.parametrize("body, loc, msg", [
    ({"toml": INLINE, "name": "a..b"}, ["body", "name"], "run name 'a..b': expected 1-64 characters"),
    ({"toml": INLINE, "name": "x" * 65}, ["body", "name"], "run name 'xxxx"),
    ({"recipe": "../x"}, ["body", "recipe"], "recipe '../x': expected a name like 'smoke'"),
    ({"toml": INLINE, "overrides": {"Training.Steps": 3}}, ["body", "overrides", "Training.Steps", "[key]"],
     "override key 'Training.Steps': expected 'section.key'"),
])
def test_names_outside_their_rules_are_told_the_rule(fake_service, body, loc, msg):
    before = run_dirs(fake_service)
    r = fake_service.create(**body)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == loc and error["msg"].startswith(msg), error
    assert "pattern" not in error["msg"]
    assert run_dirs(fake_service) == before


@pytest.mark.parametrize("field, value", [("nproc_per_node", True), ("gpus", "1"), ("restart_limit", 2.5),
                                          ("nproc_per_node", False)])
def test_a_count_that_is_not_a_json_integer_is_refused(fake_service, field, value):
    # the schema says integer: `true` and "1" were taken as 1 (pydantic's lax mode); the fuzzing test found it
    before = run_dirs(fake_service)
    r = fake_service.create(toml=INLINE, **{field: value})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", field] and error["msg"] == "Input should be a valid integer", error
    assert run_dirs(fake_service) == before


COUNTS = ("nproc_per_node", "gpus", "restart_limit")


@pytest.mark.parametrize("number, count", [(b"1.0", 1), (b"2e0", 2)])
def test_a_count_written_as_an_integral_number_is_that_integer(fake_service, number, count):
    # JSON Schema's integer, the OpenAPI schema's type, counts 1.0 and 2e0: the strict body refused them (422)
    name = f"integral-{count}"
    counts = b", ".join(b'"%s": %s' % (field.encode(), number) for field in COUNTS)
    body = b'{"toml": %s, "name": "%s", %s}' % (json.dumps(INLINE).encode(), name.encode(), counts)
    r = post_raw(fake_service, body, "application/json")
    assert r.status_code == 201, r.text
    run = r.json()
    assert [run[field] for field in COUNTS] == [count] * 3, run
    assert name in run_dirs(fake_service)


@pytest.mark.parametrize("field", COUNTS)
@pytest.mark.parametrize("number, msg", [
    (b"true", "Input should be a valid integer"),
    (b'"1"', "Input should be a valid integer"),
    (b"1.5", "Input should be a valid integer"),
    (b"1e400", "Input should be a valid integer"),  # Python's JSON parser reads it as inf
    (b"-Infinity", "Input should be a valid integer"),
    (b"1e3", "Input should be less than or equal to "),
    (b"1e300", "Input should be a valid integer"),  # past 2**53: left a float, not echoed in 301 digits
    (b"-1.0", "Input should be greater than or equal to "),
])
def test_a_count_that_is_no_integer_or_out_of_range_is_refused_naming_it(fake_service, field, number, msg):
    before = run_dirs(fake_service)
    body = b'{"toml": %s, "%s": %s}' % (json.dumps(INLINE).encode(), field.encode(), number)
    r = post_raw(fake_service, body, "application/json")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", field] and error["msg"].startswith(msg), error
    assert len(json.dumps(error["input"])) < 30, error
    assert run_dirs(fake_service) == before


def test_an_override_of_integral_number_for_an_integer_key_is_refused_as_the_tomls(fake_service):
    # overrides reach the trainer as command-line text: 1.0 stays "1.0", which an integer key refuses as the TOML's
    # `steps = 1.0` (taken as 1 it would pass here and not in the file)
    before = run_dirs(fake_service)
    r = post_raw(fake_service, b'{"toml": %s, "overrides": {"training.steps": 1.0}}' % json.dumps(INLINE).encode(),
                 "application/json")
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["msg"] == "config key 'training.steps' = '1.0': expected an integer"
    r = fake_service.create(toml=INLINE.replace("steps = 6", "steps = 1.0"))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["msg"] == "<inline TOML>: config key 'training.steps' = 1.0: expected an integer"
    assert run_dirs(fake_service) == before


@pytest.mark.parametrize("method, path, params, loc, msg", [
    ("DELETE", "", {"files": "1"}, "files", "Input should be true or false"),
    ("DELETE", "", {"files": "yes"}, "files", "Input should be true or false"),
    ("DELETE", "", {"files": "TRUE"}, "files", "Input should be true or false"),
    ("GET", "/logs", {"tail": "1_0"}, "tail", "Input should be a valid integer, unable to parse string as an integer"),
    ("GET", "/logs", {"tail": " 5"}, "tail", "Input should be a valid integer, unable to parse string as an integer"),
    ("GET", "/logs", {"tail": "+5"}, "tail", "Input should be a valid integer, unable to parse string as an integer"),
    ("GET", "/metrics", {"tail": "5.0"}, "tail", "Input should be a valid integer, unable to parse string as an integer"),
    ("GET", "/logs/stream", {"tail": "0.0"}, "tail", "Input should be a valid integer, unable to parse string as an "
                                                     "integer"),
])
def test_a_query_value_its_schema_refuses_is_refused(fake_service, method, path, params, loc, msg):
    # lax pydantic took files=1/yes/TRUE as true (DELETE removed the run's files) and tail=1_0 as 10, ' 5' as 5
    svc = fake_service
    if svc.client.get("/v1/runs/query-target").status_code == 404:
        assert svc.create(toml=INLINE, name="query-target").status_code == 201
    r = svc.client.request(method, f"/v1/runs/query-target{path}", params=params, headers=svc.auth)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["query", loc] and error["msg"] == msg, error
    assert svc.client.get("/v1/runs/query-target").status_code == 200 and "query-target" in run_dirs(svc)
    assert svc.client.request(method, f"/v1/runs/query-target{path}", params={loc: "true" if loc == "files" else "3"},
                              headers=svc.auth).status_code == 200  # the schema's own text is taken


@pytest.mark.parametrize("body, where", [
    (b'{"toml": "[model]\\nflavor = \\"\\ud800\\"\\n"}', "body.toml"),
    (b'{"toml": "", "name": "\\udc00"}', "body.name"),
    (b'{"recipe": "\\ud800"}', "body.recipe"),
    (b'{"toml": "", "overrides": {"model.flavor": "\\udc00"}}', "body.overrides.model.flavor"),
])
def test_a_string_with_an_unpaired_surrogate_is_400_not_500(fake_service, body, where):
    # Python's JSON parser takes an escaped lone surrogate; the 422 that echoed it could not be encoded (500)
    before = run_dirs(fake_service)
    r = post_raw(fake_service, body, "application/json")
    assert r.status_code == 400, r.text
    assert r.json() == {"detail": f"request body is not valid JSON: {where} holds an unpaired surrogate (text must be "
                                  "Unicode)"}
    assert run_dirs(fake_service) == before


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_an_override_number_that_is_not_finite_is_refused(fake_service, number):
    # Python's JSON parser takes NaN and Infinity (not JSON) and reads 1e400 as inf: job.description, a text key,
    # took them as "nan" and "inf" (201)
    before = run_dirs(fake_service)
    body = b'{"toml": "", "name": "not-finite", "overrides": {"job.description": ' + number + b"}}"
    r = post_raw(fake_service, body, "application/json")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "overrides", "job.description"], error
    assert error["msg"] == "Input should be a finite number", error
    assert run_dirs(fake_service) == before


def test_a_count_given_as_nan_is_refused_not_500(fake_service):
    # the 422 echoed NaN as its input, which JSON cannot write (500)
    r = post_raw(fake_service, b'{"toml": "", "nproc_per_node": NaN}', "application/json")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "nproc_per_node"] and error["input"] is None, error


def test_a_run_id_outside_the_rule_in_the_path_is_told_the_rule(fake_service):
    r = fake_service.client.get("/v1/runs/a..b")
    assert r.status_code == 422
    (error,) = r.json()["detail"]
    assert error["loc"] == ["path", "run_id"] and error["msg"].startswith("run name 'a..b': expected")


def test_a_path_no_route_has_is_named(fake_service):
    r = fake_service.client.post("/v1/runs/x/restart", headers=fake_service.auth)
    assert r.status_code == 404
    assert r.json() == {"detail": "no endpoint POST /v1/runs/x/restart; the API is listed at /docs"}
    assert fake_service.client.get("/v1/runs/nope").json() == {"detail": "no run 'nope'"}  # a run's 404 stays its own


def test_a_name_held_by_a_deleted_runs_files_is_not_offered_a_resume(fake_service):
    svc = fake_service
    assert svc.create(toml=INLINE, name="kept").status_code == 201
    svc.wait_state("kept", ("finished",))
    r = svc.create(toml=INLINE, name="kept")
    assert r.status_code == 409 and r.json()["detail"] == "run 'kept' already exists (finished); pick another name"
    assert svc.client.delete("/v1/runs/kept", headers=svc.auth).status_code == 200
    r = svc.create(toml=INLINE, name="kept")
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == ("run name 'kept' is taken: runs/kept holds the files of a deleted run (DELETE with "
                                  "files=true removes them); pick another name")
    assert svc.client.post("/v1/runs/kept/resume", headers=svc.auth).status_code == 404


def test_listing_by_several_states_answers_each(fake_service):
    svc = fake_service
    assert svc.create(toml=INLINE, name="done-one").status_code == 201
    assert svc.create(toml=INLINE, name="stopped-one", overrides={"training.steps": 4000}).status_code == 201
    svc.wait_state("done-one", ("finished",))
    svc.client.post("/v1/runs/stopped-one/stop", headers=svc.auth)
    svc.wait_state("stopped-one", ("stopped",))
    r = svc.client.get("/v1/runs", params=[("state", "finished"), ("state", "stopped")])
    assert r.status_code == 200
    got = {run["id"]: run["state"] for run in r.json()}
    assert got["done-one"] == "finished" and got["stopped-one"] == "stopped"
    assert set(got.values()) <= {"finished", "stopped"}
    only = {run["state"] for run in svc.client.get("/v1/runs", params={"state": "stopped"}).json()}
    assert only == {"stopped"}


def test_a_run_deleted_during_a_stop_or_resume_is_404_not_500(tmp_path):
    svc = Service(Settings(state_dir=tmp_path, token="x", gpus=0))
    try:
        svc.registry.insert_run("r", "inline", {}, 1, 0, 2)

        def deleted_meanwhile(run_id: str):
            svc.registry.delete_run(run_id)  # what a concurrent DELETE does between the lookup and the action
            raise KeyError(run_id)

        with pytest.raises(HTTPException) as e:
            svc.transition("r", deleted_meanwhile)
        assert e.value.status_code == 404 and e.value.detail == "no run 'r'"
    finally:
        svc.trainer_check.close()
        svc.registry.close()


def test_a_log_stream_of_a_run_deleted_meanwhile_ends_with_an_end_event(fake_service):
    svc = fake_service
    assert svc.create(toml=INLINE, name="streamed", overrides={"training.steps": 4000}).status_code == 201
    svc.wait_state("streamed", ("running",))
    with svc.client.stream("GET", "/v1/runs/streamed/logs/stream", params={"tail": 0}) as s:
        assert svc.client.delete("/v1/runs/streamed", headers=svc.auth).status_code == 200
        body = "".join(s.iter_text())
    assert body.endswith('event: end\ndata: {"state": "deleted", "message": "run \'streamed\' was deleted"}\n\n'), body


def test_a_run_directory_the_disk_cannot_hold_is_507_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from service.schemas import RunCreate

    svc = Service(Settings(state_dir=tmp_path, token="x", gpus=0))
    svc.trainer_check = lambda sub: None  # the host check is not what this test is about
    write_text = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "submitted.toml":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    try:
        with pytest.raises(HTTPException) as e:
            svc.create(RunCreate(name="full", toml=INLINE))
        assert e.value.status_code == 507
        assert e.value.detail == "cannot create run directory runs/full: No space left on device"
        assert not (tmp_path / "runs" / "full").exists() and svc.registry.get("full") is None
    finally:
        svc.registry.close()
