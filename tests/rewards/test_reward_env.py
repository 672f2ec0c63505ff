"""A reward in its own environment (mmrl/rewards/envs.py, env_server.py): `mmrl reward env create` makes a real venv
(reusing this venv's site-packages, so nothing is downloaded) with `six` 1.16.0 while this venv has another version,
and a flow_grpo run scores through `mmrl reward serve` started in it: the scores are computed with the env's six.

Offline: the two packages installed into the env are wheels built here (`_wheel`), pip runs with PIP_NO_INDEX=1."""

import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

import mmrl.cli as cli
from mmrl.rewards import load
from mmrl.rewards.envs import MANIFEST, RewardEnvError, resolve_env
from mmrl.rewards.env_server import check_serve_spec
from mmrl.testing import child_env, child_processes, metrics_rows, process_ended

ROOT = Path(__file__).resolve().parents[2]
SIX_IN_ENV = "1.16.0"
# the reward served from the env: six's version as a number (1.16 -> 116), so a score says which six it imported
PROBE = '''import os, signal
import six


def six_version(images, **kwargs):
    major, minor = six.__version__.split(".")[:2]
    return [int(major) * 100 + int(minor)] * len(images)


def dies(images, **kwargs):  # a server killed while it scores (the OOM killer, kill -9)
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _wheel(out_dir: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel holding `files` (path -> text), built without pip or the network."""
    dist = f"{name}-{version}.dist-info"
    entries = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
               f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: mmrl-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in entries.items()]
    entries[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in entries.items():
            z.writestr(p, t)
    return path


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """The directory holding reward env 'probe', made by the real command."""
    base = tmp_path_factory.mktemp("reward-env")
    six = _wheel(base, "six", SIX_IN_ENV, {"six.py": f'__version__ = "{SIX_IN_ENV}"\n'})
    probe = _wheel(base, "mmrl_env_probe", "0.1", {"mmrl_env_probe.py": PROBE})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIP_NO_INDEX", "1")
        t0 = time.time()
        assert cli.main(["reward", "env", "create", "probe", "--dir", str(base / "envs"), "--reuse-site-packages",
                         "--packages", f"{six} {probe}"]) == 0
        print(f"env created in {time.time() - t0:.1f} s")
    return base / "envs"


def _serve_processes() -> dict[int, str]:
    return {pid: cmd for pid, cmd in child_processes(os.getpid()).items() if " reward serve " in cmd}


def _train(tmp_path, envs, serve_name: str) -> int:
    cfg = yaml.safe_load((ROOT / "configs" / "diffusion" / "flow_grpo_tiny.yaml").read_text())
    cfg["reward"]["components"] = {"six": {"reward": "remote", "env": "probe", "env_dir": str(envs),
                                           "serve": {"name": serve_name}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cli.main(["train", str(path), f"output_dir={tmp_path / 'run'}",
                     f"model.path={ROOT / 'assets/tiny_sd3_shapes'}",
                     f"data.train_prompts={ROOT / 'assets/prompts/shapes_train.txt'}",
                     f"data.eval_prompts={ROOT / 'assets/prompts/shapes_eval.txt'}", "train.max_steps=1",
                     "train.save_every=0", "rollout.num_steps=2", "rollout.prompts_per_step=1", "rollout.group_size=2",
                     "log.eval_every=0", "log.sample_every=0"])


def test_env_create_writes_its_manifest_lists_it_and_refuses_a_second_create(envs, capsys):
    env = envs / "probe"
    manifest = json.loads((env / MANIFEST).read_text())
    assert manifest["python"] == "%d.%d.%d" % sys.version_info[:3] and manifest["source"] == str(ROOT)
    assert any(line.startswith("six @ file:") for line in manifest["freeze"]), manifest["freeze"]
    assert manifest["reuse_site_packages"] and resolve_env("probe", envs) == env
    # the env sees its own six; this venv another one
    seen = subprocess.run([str(env / "bin" / "python"), "-c", "import six, mmrl; print(six.__version__, "
                           "mmrl.__file__)"], capture_output=True, text=True, check=True,
                          env={"PATH": os.environ["PATH"]}).stdout.split()
    assert seen == [SIX_IN_ENV, str(ROOT / "mmrl" / "__init__.py")]
    assert importlib.metadata.version("six") != SIX_IN_ENV
    assert cli.main(["reward", "env", "list", "--dir", str(envs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("probe  python 3.") and "(reuses the trainer's site-packages)" in out
    with pytest.raises(SystemExit):
        cli.main(["reward", "env", "create", "probe", "--dir", str(envs)])
    err = capsys.readouterr().err.strip()
    assert err == (f"mmrl reward: error: reward env 'probe' already exists at {env}; remove that directory to create "
                   "it again, or pick another NAME")
    (envs / "notanenv").mkdir()
    (envs / "notanenv" / "x").write_text("")
    with pytest.raises(SystemExit):
        cli.main(["reward", "env", "create", "notanenv", "--dir", str(envs)])
    assert capsys.readouterr().err.strip() == (f"mmrl reward: error: {envs / 'notanenv'} exists and is not an mmrl "
                                               f"reward env (no {MANIFEST}); pick another NAME or --dir, or remove it")


@pytest.mark.slow
def test_a_run_scores_through_the_envs_server_and_stops_it(envs, tmp_path, capsys):
    t0 = time.time()
    logs = set((envs / "probe" / "logs").glob("serve-*.log"))
    assert _train(tmp_path, envs, "mmrl_env_probe:six_version") == 0
    rows = metrics_rows(tmp_path / "run")
    assert rows[0]["reward/mean"] == 116.0  # six 1.16 in the env (this venv's would give 117)
    # the server is gone (and its log with it: it stopped cleanly)
    assert _serve_processes() == {} and set((envs / "probe" / "logs").glob("serve-*.log")) == logs
    print(f"1-step run through the env's server: {time.time() - t0:.1f} s")


@pytest.mark.slow
def test_a_killed_server_fails_the_run_in_one_line(envs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMRL_NO_PROGRESS", "1")  # stderr then holds the error alone
    assert _train(tmp_path, envs, "mmrl_env_probe:dies") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"mmrl: error: reward server 'mmrl_env_probe:dies' in env {envs / 'probe'} (PID ")
    assert ("died from signal 9 (SIGKILL: e.g. the OOM killer, or kill -9); its last output: serving reward 'dies'"
            in err)
    assert _serve_processes() == {}


def test_a_server_that_cannot_start_fails_the_load_with_its_last_output(envs):
    with pytest.raises(RewardEnvError) as info:
        load("remote", env="probe", env_dir=str(envs), serve={"name": "no_such_module:f"})
    msg = str(info.value)
    assert msg.startswith(f"reward server 'no_such_module:f' in env {envs / 'probe'} exited with code 2 before it "
                          "listened: mmrl reward: error: reward 'no_such_module:f': cannot import 'no_such_module' "
                          "(ModuleNotFoundError: No module named 'no_such_module')")
    assert "\n" not in msg and _serve_processes() == {}


def test_a_missing_env_and_a_bad_serve_spec_are_one_line(envs, tmp_path):
    with pytest.raises(RewardEnvError, match=r"^reward env 'nope' not found: no directory .*/nope; create it with "
                                             r"`mmrl reward env create nope` \(--dir .*\), or `mmrl reward env list`"):
        load("remote", env="nope", env_dir=str(envs), serve={"name": "x:y"})
    (tmp_path / "half").mkdir()
    with pytest.raises(RewardEnvError, match=r"half is not an mmrl reward env \(no readable mmrl-reward-env.json"):
        load("remote", env=str(tmp_path / "half"), serve={"name": "x:y"})
    with pytest.raises(ValueError, match=r"^serve.kw: expected a mapping of load arguments, got 3$"):
        check_serve_spec({"name": "x", "kw": 3})
    with pytest.raises(ValueError, match=r"^serve.port: unknown key; valid: name \("):
        check_serve_spec({"name": "x", "port": 3})
    with pytest.raises(ValueError, match=r"give url= \(a server you started\) or env= with serve="):
        load("remote", url="http://127.0.0.1:1", env="probe", serve={"name": "x"})


@pytest.mark.slow
def test_the_server_exits_when_the_process_that_started_it_is_killed(envs):
    """A run killed with SIGKILL (no cleanup runs) leaves no server: `--parent-pid` ends it."""
    code = ("import os, signal; from mmrl.rewards import load; "
            f"r = load('remote', env='probe', env_dir={str(envs)!r}, serve={{'name': 'mmrl_env_probe:six_version'}}); "
            "print(r.server.proc.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout.split()[0])
    end = time.time() + 10
    while not process_ended(pid) and time.time() < end:
        time.sleep(0.1)
    assert process_ended(pid)


def test_serving_imports_no_trainer_library():
    """What `mmrl reward serve` imports needs only SERVE_REQUIREMENTS (a reward env without diffusers, peft...)."""
    code = ("import sys, mmrl.cli; from mmrl.rewards.cli import load_reward_from_args; "
            "from mmrl.rewards.remote import serve; "
            "serve(load_reward_from_args('jpeg_compressibility', None, [], 'cpu'), port=0, block=False).shutdown(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers', 'peft', "
            "'torchvision', 'open_clip', 'accelerate', 'matplotlib', 'pyarrow', 'av', 'safetensors'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    assert out.stdout.strip() == "[]"


def test_a_failed_create_removes_the_env_and_says_why_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(SystemExit):
        cli.main(["reward", "env", "create", "bad", "--dir", str(tmp_path), "--reuse-site-packages",
                  "--packages", "no-such-package-xyz==1.0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after pip's own output
    assert err.startswith("mmrl reward: error: installing the packages failed (exit code 1): ") and \
        "no-such-package-xyz==1.0" in err
    assert not (tmp_path / "bad").exists()


def test_closes_runs_stops_what_is_registered_on_return_too():
    """`close_on_failure(..., on_return=True)` (the reward servers a run started) closes on a return as well."""
    from mmrl.run.start import _FAILURE_CLOSERS, close_on_failure, closes_runs

    closed = []
    close_on_failure(lambda: "snapshot", closed.append, None, on_return=True)
    try:
        closes_runs(lambda cfg: {})(None)
    finally:
        _FAILURE_CLOSERS.pop()
    assert closed == ["snapshot"]
