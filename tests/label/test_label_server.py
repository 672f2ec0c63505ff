"""`mmrl label`'s queue, record and HTTP API without a browser: http.client against a server on a free port."""

import json
import shutil
import time
from pathlib import Path

import pytest

from mmrl.label import LabelServer, build_queue
from mmrl.label.store import log_path
from mmrl.pipelines.data import load_preference_pairs


def events(out):
    return [json.loads(x) for x in log_path(Path(out)).read_text().splitlines()]


def rows(out):
    return [json.loads(x) for x in Path(out).read_text().splitlines()]


# ----------------------------------------------------------------------------------------- the queue


def test_queue_groups_by_file_name_pairs_every_two_and_ids_follow_the_content(samples, tmp_path):
    q = build_queue(samples)
    assert len(q) == 6  # 2 prompts x C(3, 2)
    assert {it.prompt for it in q} == {"a cube number 0", "a cube number 1"}  # from cube<p>.txt
    assert all(it.files[0].stem.rsplit("_", 1)[0] == it.files[1].stem.rsplit("_", 1)[0] for it in q)
    moved = tmp_path / "elsewhere"
    shutil.copytree(samples, moved)
    for f in sorted(moved.glob("cube0_*.png")):  # renamed within the group: same contents, same ids
        f.rename(f.with_name("cube0_" + str(9 - int(f.stem[-1])) + ".png"))
    assert [it.pair_id for it in build_queue(moved)] == [it.pair_id for it in q]
    (moved / "cube0_9.png").write_bytes((samples / "cube1_0.png").read_bytes())  # a changed sample: new ids
    assert len({it.pair_id for it in build_queue(moved)} - {it.pair_id for it in q}) == 2


def test_queue_from_prompts_jsonl_an_eval_folder_and_a_run_directory(samples, tmp_path):
    (samples / "prompts.jsonl").write_text(json.dumps({"prompt": "p", "images": ["cube0_0.png", "cube0_1.png"]})
                                           + "\n" + json.dumps({"prompt": "p", "image": "cube1_2.png"}) + "\n")
    q = build_queue(samples)
    assert len(q) == 3 and {it.prompt for it in q} == {"p"}
    run = tmp_path / "run"
    for step, names in (("base", ["cube0_0.png"]), ("step_3", ["cube0_1.png", "cube0_2.png"])):
        (run / "eval" / step / "images").mkdir(parents=True)
        for n in names:
            shutil.copy(samples / n, run / "eval" / step / "images" / n)
        report = {"per_prompt": [{"prompt": "q", "images": [f"images/{n}" for n in names]}]}
        (run / "eval" / step / "eval_report.json").write_text(json.dumps(report))
    assert len(build_queue(run / "eval" / "step_3")) == 1  # one eval folder: its 2 samples
    q = build_queue(run)  # both folders merged by prompt: base against step_3 too
    assert len(q) == 3 and {f.parent.parent.name for it in q for f in it.files} == {"base", "step_3"}


def test_a_run_directory_without_evaluations_and_a_source_without_pairs_are_refused_in_one_line(samples, tmp_path):
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text("algorithm: flow_grpo\n")
    with pytest.raises(ValueError, match=r"^.*run is a run directory without evaluations: its samples/ grids hold "
                                         r"many prompts in one picture with their rewards; run `mmrl eval .*run` "
                                         r"first \(it writes eval/<step>/\)$"):
        build_queue(run)
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(samples / "cube0_0.png", one / "a_0.png")
    shutil.copy(samples / "cube0_0.png", one / "a_1.png")  # the same content twice is one sample
    with pytest.raises(ValueError, match=r"\(file names\): no prompt has 2 distinct samples to compare \(1 prompts, "
                                         r"samples per prompt: \[2\]\)"):
        build_queue(one)


# ----------------------------------------------------------------------------------------- what is written


def test_choices_become_pick_a_pic_rows_that_the_dpo_loader_reads(serve, tmp_path):
    (tmp_path / "out").mkdir()
    server, c = serve(out=tmp_path / "out" / "prefs.jsonl")  # samples outside its folder: absolute paths
    first, second, third = [], [], []
    for choice, got in (("left", first), ("right", second), ("tie", third)):
        item = c.next()
        got.append(item)
        assert c.label(item, choice) == (200, {"recorded": True, "progress": {
            "labelled": len(first) + len(second) + len(third), "skipped": 0, "total": 6,
            "remaining": 6 - len(first) - len(second) - len(third)}})
    item = c.next()
    assert c.label(item, "skip")[1]["progress"] == {"labelled": 3, "skipped": 1, "total": 6, "remaining": 2}
    out = rows(tmp_path / "out" / "prefs.jsonl")
    assert [(r["pair_id"], r["label_0"]) for r in out] == [(first[0]["pair_id"], 1), (second[0]["pair_id"], 0),
                                                           (third[0]["pair_id"], 0.5)]  # the skip writes no row
    shown = server.items[first[0]["pair_id"]].files
    assert out[0]["image_0"] == str(shown[0]) and out[0]["image_1"] == str(shown[1])  # left is image_0
    pairs = load_preference_pairs(tmp_path / "out" / "prefs.jsonl")  # the tie carries no preference
    assert [(p.chosen, p.rejected) for p in pairs] == [
        (shown[0], shown[1]), tuple(reversed(server.items[second[0]["pair_id"]].files))]


def test_samples_inside_the_output_folder_are_written_relative_to_it(serve, tmp_path):
    server, c = serve(out=tmp_path / "prefs.jsonl")  # the samples are in tmp_path/samples
    item = c.next()
    c.label(item, "right")
    (row,) = rows(tmp_path / "prefs.jsonl")
    assert (row["image_0"], row["image_1"]) == tuple(f"samples/{f.name}" for f in server.items[item["pair_id"]].files)
    server.shutdown()
    shutil.move(tmp_path, tmp_path.parent / "moved")  # the folder moves with its samples: still readable
    (pair,) = load_preference_pairs(tmp_path.parent / "moved" / "prefs.jsonl")
    assert pair.chosen == tmp_path.parent / "moved" / row["image_1"]


def test_best_of_three_pairs_the_chosen_sample_with_each_other_one(serve, tmp_path):
    (tmp_path / "out").mkdir()
    server, c = serve(k=3, out=tmp_path / "out" / "prefs.jsonl")
    item = c.next()
    assert item["k"] == 3 and len(item["media"]) == 3
    assert c.label(item, "left")[0] == 400  # left/right name one of two samples
    assert c.label(item, 2)[0] == 200
    files = [str(f) for f in server.items[item["pair_id"]].files]
    assert [(r["image_0"], r["image_1"], r["label_0"]) for r in rows(tmp_path / "out" / "prefs.jsonl")] == [
        (files[2], files[0], 1), (files[2], files[1], 1)]


# ----------------------------------------------------------------------------------------- bad requests


def test_unknown_forged_and_replayed_labels_are_refused_or_idempotent(serve, tmp_path):
    server, c = serve()
    item = c.next()
    assert c.call("POST", "/api/label", {"pair_id": "0" * 20, "choice": "left", "lease": item["lease"]}) == (
        404, {"error": "unknown pair id '00000000000000000000': label items handed out by GET /api/next"})
    assert c.label({**item, "lease": "forg\u00e9d"}, "left")[0] == 409  # not ASCII: still compared, no 500
    assert c.label({**item, "lease": "forged"}, "left") == (409, {"error": (
        f"lease is not valid for pair {item['pair_id']}: the pair was handed to another tab (after this lease "
        f"expired) or never to this one; GET /api/next for a pair")})
    other = server.order[-1]  # a pair of the queue never handed out: no lease fits
    assert c.call("POST", "/api/label", {"pair_id": other, "choice": 0, "lease": item["lease"]})[0] == 409
    assert c.label(item, "sideways") == (400, {"error": "choice must be left, right, 0..1, tie or skip, got "
                                                        "'sideways'"})
    assert c.label(item, True)[0] == 400
    assert c.call("POST", "/api/label", {"pair_id": item["pair_id"], "choice": "left"}) == (
        400, {"error": "lease missing: send the lease GET /api/next gave with this pair"})
    assert c.call("POST", "/api/label", b"{not json") [0] == 400
    assert c.call("POST", "/api/label", b"[1]") == (400, {"error": "body must be a JSON object, got list"})
    assert c.call("POST", "/api/label", b'{"pair_id": "x"}', headers={"Content-Type": "text/plain"}) == (
        415, {"error": "Content-Type must be application/json"})  # what a cross-site form would send
    assert events(tmp_path / "prefs.jsonl") == []  # none of it was recorded
    assert c.label(item, "left")[0] == 200
    assert c.label(item, "left") == (200, {"recorded": False, "already_recorded": True, "progress": {
        "labelled": 1, "skipped": 0, "total": 6, "remaining": 5}})  # a replay: no second row
    assert c.label(item, "right") == (409, {"error": f"pair {item['pair_id']} is already labelled (0); undo it first "
                                                     f"(POST /api/undo from the session that labelled it)"})
    assert len(rows(tmp_path / "prefs.jsonl")) == 1 and len(events(tmp_path / "prefs.jsonl")) == 1
    assert c.call("GET", "/api/next?session=../x")[0] == 400
    assert c.call("GET", "/api/next?session=x%0A")[0] == 400  # a newline after a good name
    assert c.call("GET", "/etc/passwd") == (404, {"error": "unknown path '/etc/passwd'"})


@pytest.mark.parametrize("path", ["/media/../../etc/passwd", "/media/%2e%2e/%2e%2e/etc/passwd", "/media//etc/passwd",
                                  "/media/{id}/..%2F..%2Fetc%2Fpasswd", "/media/{id}/0/../../../etc/passwd",
                                  "/media/{id}/2", "/media/{id}/-1", "/media/{id}/%30", "/media/{id}",
                                  "/media/%2Fetc%2Fpasswd/0", "/media/cube0_0.png/0"])
def test_media_serves_queued_samples_by_id_only_never_a_path_from_the_request(serve, samples, path):
    server, c = serve()
    pid = server.order[0]
    status, body, headers = c.call("GET", f"/media/{pid}/1", raw=True)
    assert (status, headers["Content-Type"], body) == (200, "image/png", server.items[pid].files[1].read_bytes())
    status, body, _ = c.call("GET", path.format(id=pid), raw=True)
    assert status == 404 and json.loads(body)["error"].startswith("no such sample ")


def test_a_token_is_required_from_every_request_when_set(serve):
    server, c = serve(token="s3c;r et")  # characters a cookie must carry quoted
    assert c.call("GET", "/api/progress") == (401, {"error": "missing or wrong token: open the URL mmrl label printed "
                                                             "(/?token=...), or send 'Authorization: Bearer <token>'"})
    assert c.call("GET", "/")[0] == 401 and c.call("GET", f"/media/{server.order[0]}/0", raw=True)[0] == 401
    assert c.call("POST", "/api/undo", {"session": "a"})[0] == 401
    assert c.call("GET", "/api/progress", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert c.call("GET", "/?token=wrong")[0] == 401
    status, _, headers = c.call("GET", "/?token=s3c%3Br%20et", raw=True)  # the printed URL: a cookie, the token leaves
    assert (status, headers["Location"]) == (303, "/")
    cookie = headers["Set-Cookie"].split(";")[0]
    assert cookie == "mmrl_label_token=s3c%3Br%20et" and "HttpOnly; SameSite=Strict" in headers["Set-Cookie"]
    assert c.call("GET", "/", headers={"Cookie": cookie}, raw=True)[0] == 200
    assert c.call("GET", "/api/progress", headers={"Cookie": "mmrl_label_token=nope"})[0] == 401
    scripted = type(c)(server, {"Authorization": "Bearer s3c;r et"})
    item = scripted.next()
    assert scripted.label(item, "left")[0] == 200


def test_binding_beyond_loopback_without_a_token_is_refused(samples, tmp_path):
    with pytest.raises(ValueError, match=r"^--host 0.0.0.0 lets other machines reach the page: pass --token \(or set "
                                         r"MMRL_LABEL_TOKEN\), or keep the default --host 127.0.0.1$"):
        LabelServer(build_queue(samples), tmp_path / "p.jsonl", host="0.0.0.0")
    assert not (tmp_path / "p.jsonl").exists()


# ----------------------------------------------------------------------------------------- tabs, undo, restarts


def test_two_sessions_never_get_the_same_pair_and_an_abandoned_lease_returns(serve, tmp_path):
    server, c = serve(lease_seconds=0.5)
    a, b = c.next("tabA"), c.next("tabB")
    assert a["pair_id"] != b["pair_id"]
    assert c.next("tabA") == {**a, "progress": a["progress"]}  # a reload of tab A: the same pair, the same lease
    held = {c.next(f"t{i}")["pair_id"] for i in range(4)}
    assert len(held | {a["pair_id"], b["pair_id"]}) == 6
    assert c.next("late") == {"pair_id": None, "held_by_other_tabs": 6, "progress": {
        "labelled": 0, "skipped": 0, "total": 6, "remaining": 6}}
    time.sleep(0.6)  # every lease expired (the tabs were closed)
    taken = c.next("late")
    assert taken["pair_id"] == server.order[0]
    stale = a if a["pair_id"] == taken["pair_id"] else b if b["pair_id"] == taken["pair_id"] else None
    if stale is not None:  # the old tab's lease lost its pair to the new tab
        assert c.label(stale, "left")[0] == 409
    assert c.label(taken, "left")[0] == 200
    other = b if stale is a else a
    assert c.label(other, "right")[0] == 200  # expired, but nobody else took it: the choice is kept
    assert sorted(e["pair_id"] for e in events(tmp_path / "prefs.jsonl")) == sorted({taken["pair_id"],
                                                                                     other["pair_id"]})


def test_undo_retracts_the_newest_choice_of_its_own_session_and_hands_the_pair_back(serve, tmp_path):
    server, c = serve()
    a1 = c.next("a")
    c.label(a1, "left")
    b1 = c.next("b")
    c.label(b1, "tie")
    a2 = c.next("a")
    status, undone = c.call("POST", "/api/undo", {"session": "a"})
    assert status == 200 and undone["undone"] == a1["pair_id"] and undone["item"]["pair_id"] == a1["pair_id"]
    assert [r["pair_id"] for r in rows(tmp_path / "prefs.jsonl")] == [b1["pair_id"]]  # b's choice stays
    assert c.next("a")["pair_id"] == a1["pair_id"]  # the undone pair is this tab's again, a2 is free
    assert c.next("z")["pair_id"] == a2["pair_id"]
    assert c.label(a1, "left")[0] == 409  # the retracted lease cannot record again
    assert c.label(undone["item"], "right")[0] == 200
    assert c.call("POST", "/api/undo", {"session": "nobody"}) == (200, {"undone": None, "progress": {
        "labelled": 2, "skipped": 0, "total": 6, "remaining": 4}})
    assert [e["event"] for e in events(tmp_path / "prefs.jsonl")] == ["label", "label", "undo", "label"]
    assert [(r["pair_id"], r["label_0"]) for r in rows(tmp_path / "prefs.jsonl")] == [
        (b1["pair_id"], 0.5), (a1["pair_id"], 0)]


def test_a_restart_continues_where_the_last_run_stopped(serve, tmp_path):
    server, c = serve()
    done = []
    for choice in ("left", "skip", "right"):
        item = c.next()
        c.label(item, choice)
        done.append(item["pair_id"])
    before = (tmp_path / "prefs.jsonl").read_text()
    server.shutdown()
    (tmp_path / "prefs.jsonl").write_text("")  # a crash between the log line and the rewrite: rebuilt from the log
    server, c = serve()
    assert (tmp_path / "prefs.jsonl").read_text() == before
    seen = set()
    while (item := c.next())["pair_id"] is not None:
        seen.add(item["pair_id"])
        c.label(item, "tie")
    assert seen == set(server.order) - set(done)
    assert c.call("GET", "/api/progress") == (200, {"labelled": 5, "skipped": 1, "total": 6, "remaining": 0})
    assert c.call("POST", "/api/undo", {"session": "tab1"})[1]["undone"] is not None  # the session's stack survives


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_earlier_ones_are_kept(serve, tmp_path, capsys):
    server, c = serve()
    for choice in ("left", "right"):
        c.label(c.next(), choice)
    server.shutdown()
    log = log_path(tmp_path / "prefs.jsonl")
    good = log.read_bytes()
    torn = b'{"event": "label", "pair_id": "ab'
    log.write_bytes(good + torn)  # the server died mid-write
    server, c = serve()
    assert f"dropped a torn last line ({len(torn)} bytes, written when the server stopped mid-write" in \
        capsys.readouterr().err
    assert log.read_bytes() == good and c.call("GET", "/api/progress")[1]["labelled"] == 2
    c.label(c.next(), "left")
    server.shutdown()
    assert len(events(tmp_path / "prefs.jsonl")) == 3
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join([lines[0], b"garbage", *lines[1:]]))  # not the last line: refused, nothing rewritten
    with pytest.raises(ValueError, match=r"prefs.events.jsonl line 2 is not a label event .*; the log is the record "
                                         r"of every choice and is never rewritten: repair or move that line, then "
                                         r"restart$"):
        serve()


def test_one_server_per_output_and_never_over_a_file_it_did_not_write(serve, samples, tmp_path):
    serve()
    with pytest.raises(ValueError, match=r"^another mmrl label is writing .*prefs.events.jsonl \(one labelling server "
                                         r"per --out file\); stop it or choose another --out$"):
        LabelServer(build_queue(samples), tmp_path / "prefs.jsonl")
    (tmp_path / "mine.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"^--out .*mine.jsonl exists and has no event log mine.events.jsonl beside "
                                         r"it: it was not written by mmrl label, which would overwrite it; choose "
                                         r"another --out$"):
        LabelServer(build_queue(samples), tmp_path / "mine.jsonl")
    assert (tmp_path / "mine.jsonl").read_text() == '{"prompt": "x"}\n'
