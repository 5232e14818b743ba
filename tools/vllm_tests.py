"""vLLM's own scheduler tests, run against vLLM's scheduler or against qualia.vllm.Scheduler.

    python tools/vllm_tests.py fetch --version 0.32.0 --dest DIR   # vLLM's tests into DIR/tests
    python tools/vllm_tests.py run --src DIR --scheduler qualia|stock [--junit FILE] [pytest args]

`fetch` takes vLLM's source distribution through the package index pip is configured with (pip's
own `download` of it stops at its metadata step: the built version carries a local label),
checks its sha256 against the index, and unpacks its tests/ folder.  `run` writes the configs of
the models the tests name (config.json only, at the published sizes) to DIR/models, points vLLM
at them (VLLM_MODEL_REDIRECT_PATH), and runs tests/v1/core/test_scheduler.py and
test_async_scheduler.py with the plugin tests/on_vllm/scheduler_plugin.py, which hands every
scheduler those tests create to the chosen class.  It prints the counts.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pathlib
import ssl
import subprocess
import sys
import tarfile
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py")


def _pip_config() -> dict:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout
    conf = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        conf[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    return conf


def _index_url(conf: dict) -> str:
    url = os.environ.get("PIP_INDEX_URL") or conf.get("index-url")
    if not url:
        from pip._internal.models.index import PyPI

        url = PyPI.simple_url
    return url.rstrip("/") + "/"


def _ssl_context(conf: dict) -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or conf.get("cert") or None
    return ssl.create_default_context(cafile=cafile)


def fetch(version: str, dest: pathlib.Path) -> None:
    if (dest / "tests" / "v1" / "core" / "test_scheduler.py").exists():
        print(f"vLLM {version} tests already in {dest}")
        return
    conf = _pip_config()
    ctx = _ssl_context(conf)
    page = _index_url(conf) + "vllm/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, context=ctx, timeout=120) as resp:
        files = json.load(resp)["files"]
    name = f"vllm-{version}.tar.gz"
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise SystemExit(f"the package index has no {name}")
    with urllib.request.urlopen(entry["url"], context=ctx, timeout=600) as resp:
        data = resp.read()
    want = entry.get("hashes", {}).get("sha256")
    if want and hashlib.sha256(data).hexdigest() != want:
        raise SystemExit(f"{name}: sha256 mismatch")
    prefix = f"vllm-{version}/"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix + "tests/") and (m.isfile() or m.isdir()):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(dest, members=members)
    print(f"vLLM {version} tests unpacked into {dest / 'tests'}")


def write_models(dest: pathlib.Path) -> pathlib.Path:
    """Config-only folders for the models the scheduler tests name, and the redirect file."""
    from transformers import OPTConfig

    redirect = {}
    folder = dest / "facebook--opt-125m"
    if not (folder / "config.json").exists():
        OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                  num_attention_heads=12, max_position_embeddings=2048, word_embed_proj_dim=768,
                  do_layer_norm_before=True, activation_function="relu", enable_bias=True,
                  bos_token_id=2, eos_token_id=2, pad_token_id=1, torch_dtype="float16",
                  architectures=["OPTForCausalLM"]).save_pretrained(folder)
    redirect["facebook/opt-125m"] = str(folder)
    path = dest / "redirect.json"
    path.write_text(json.dumps(redirect))
    return path


def counts(junit: str) -> dict:
    """passed / failed / skipped counts of a junit file."""
    import xml.etree.ElementTree as ET

    out = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"] += 1
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def run(src: pathlib.Path, scheduler: str, junit: str, extra: list) -> int:
    redirect = write_models(src / "models")
    env = dict(os.environ)
    env.update(VLLM_MODEL_REDIRECT_PATH=str(redirect), HF_HUB_OFFLINE="1",
               QUALIA_VLLM_TESTS_SCHEDULER=scheduler,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "on_vllm"), str(src)]))
    cmd = [sys.executable, "-m", "pytest", "-p", "scheduler_plugin", "-p", "no:cacheprovider",
           "--noconftest", "-q", "-rfE", "--tb=line", "-W", "ignore", "--rootdir", str(src)]
    if junit:
        cmd += ["--junitxml", junit]
    cmd += [str(src / f) for f in TEST_FILES] + extra
    return subprocess.run(cmd, cwd=src, env=env, check=False).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--version", required=True)
    f.add_argument("--dest", required=True, type=pathlib.Path)
    r = sub.add_parser("run")
    r.add_argument("--src", required=True, type=pathlib.Path)
    r.add_argument("--scheduler", choices=("qualia", "stock"), required=True)
    r.add_argument("--junit", default="")
    r.add_argument("--expect-pass", type=int, default=None,
                   help="exit 0 when at least this many tests pass (the rest are reported), "
                        "1 otherwise")
    args, extra = ap.parse_known_args()
    if args.cmd == "fetch":
        fetch(args.version, args.dest)
        return 0
    if args.expect_pass is None:
        return run(args.src, args.scheduler, args.junit, extra)
    junit = args.junit or str(args.src / f"junit-{args.scheduler}.xml")
    run(args.src, args.scheduler, junit, extra + ["--quiet"])
    c = counts(junit)
    name = "qualia.vllm.Scheduler" if args.scheduler == "qualia" else "vLLM's Scheduler"
    print(f"vLLM scheduler tests under {name}: {c['passed']} pass / {c['failed']} fail / "
          f"{c['skipped']} skipped (need {args.expect_pass} passing)")
    return 0 if c["passed"] >= args.expect_pass else 1


if __name__ == "__main__":
    sys.exit(main())
